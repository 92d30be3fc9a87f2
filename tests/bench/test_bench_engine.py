"""Micro-benchmarks (pytest-benchmark): run `pytest tests/bench --benchmark-enable` to print timings.
Under `make test` they run once each as plain tests."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv.block_pool import BlockPool
from engine.kv.prefix_cache import PrefixCache, root
from tests.helpers import random_ids


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_bench_decode_tiny(benchmark, tiny_dir, storage):
    llm = LLM(model=tiny_dir, dtype="float32", kv_storage=storage)
    prompt = random_ids(64, seed=1)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    out = benchmark(lambda: llm.generate(prompt, params)[0])
    assert len(out.token_ids) == 64


def test_bench_prefix_match(benchmark):
    cache = PrefixCache(32)
    pool = BlockPool(64, 32, index=cache)
    tokens = random_ids(32 * 60, seed=2)
    parent = root(None)
    for i in range(60):
        parent = cache.register(pool.allocate(), parent, tokens[i * 32:(i + 1) * 32])
    assert len(benchmark(cache.match, tokens)) == 60
