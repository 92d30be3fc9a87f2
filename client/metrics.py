"""Read metrics from a Prometheus text endpoint (Triton's :8002/metrics or the server's /metrics)."""
from __future__ import annotations

import urllib.request


def scrape_many(url: str, *names: str, **labels: str) -> list[float]:
    """For each name, the sum of its samples whose labels include `labels` (0 when none), from one fetch."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        name = key.split("{")[0]
        if name in totals and all(f'{k}="{v}"' in key for k, v in labels.items()):
            totals[name] += float(value)
    return [totals[n] for n in names]


def scrape(url: str, name: str, **labels: str) -> float:
    return scrape_many(url, name, **labels)[0]
