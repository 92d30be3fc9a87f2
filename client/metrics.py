"""Read one metric from a Prometheus text endpoint (Triton's :8002/metrics or the server's /metrics)."""
from __future__ import annotations

import urllib.request


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`; 0 when there are none."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total
