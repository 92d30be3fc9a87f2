"""Micro-benchmark: paged decode attention on the CPU reference path, contiguous vs shuffled block tables.
`pytest tests/bench/test_bench_attention.py --benchmark-enable -s` prints both timings and their ratio."""
from __future__ import annotations

import pytest
import torch

from perf.bench_attention import setup

MEDIANS: dict[str, float] = {}


@pytest.mark.parametrize("tables", ["contiguous", "shuffled"])
def test_bench_decode_attention_tables(benchmark, tables):
    call, moved = setup("reference", torch.device("cpu"), torch.float32, 4, 2048, tables == "shuffled")
    out = benchmark(call)
    assert out.shape == (4, 14, 64) and torch.isfinite(out).all() and moved == 2 * 4 * 2048 * 2 * 64 * 4
    if benchmark.stats is not None:                      # timings exist only with --benchmark-enable
        MEDIANS[tables] = benchmark.stats.stats.median
    if len(MEDIANS) == 2:
        print(f"\ndecode attention (CPU reference, batch 4, context 2048): shuffled/contiguous = "
              f"{MEDIANS['shuffled'] / MEDIANS['contiguous']:.3f}")
