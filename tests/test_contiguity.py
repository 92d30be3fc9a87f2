"""Block-table contiguity on a hit/miss workload, through the engine: the allocator keeps tables consecutive where
the old policy (release order) scatters them, and the gauge reports it."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv.paged import contiguity
from tests.helpers import random_ids


def hit_miss_contiguity(path: str, contiguous: bool) -> float:
    """Alternating pairs of two concurrent MISS prompts, then two HITs sharing all but their last 10 tokens."""
    llm = LLM(model=path, kv_storage="paged", dtype="float32", block_size=16, num_kv_blocks=512,
              contiguous_blocks=contiguous)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    body = random_ids(92, seed=1)
    for pair in range(6):
        misses = [random_ids(8, seed=100 + 2 * pair + i) + body for i in range(2)]
        llm.generate(misses, params)
        hits = llm.generate([m[:-10] + random_ids(10, seed=500 + 2 * pair + i) for i, m in enumerate(misses)], params)
        assert [h.cached_tokens for h in hits] == [80, 80]
    m = llm.engine.metrics
    assert m.value("pagoda_block_table_pairs_total") == 24 * 8          # 24 requests, 9 blocks each
    return m.value("pagoda_block_table_contiguity")


def test_allocator_keeps_tables_contiguous_where_the_old_policy_scatters(tiny_dir):
    new, old = hit_miss_contiguity(tiny_dir, True), hit_miss_contiguity(tiny_dir, False)
    assert new >= 0.9, new          # a HIT breaks once, where its fresh tail follows the adopted prefix
    assert old < 0.75, old          # two tables growing together interleave their blocks


def test_contiguity_of_a_table():
    assert contiguity([4, 5, 6, 9, 10]) == (4, 3)
    assert contiguity([7]) == (0, 0) and contiguity([]) == (0, 0)
    assert contiguity([3, 2, 1]) == (2, 0)


def test_gauge_starts_at_one_and_dense_storage_leaves_it(tiny_dir):
    llm = LLM(model=tiny_dir, kv_storage="dense", max_batch_size=1, dtype="float32")
    llm.generate(random_ids(20, seed=3), SamplingParams(max_tokens=4, temperature=0.0))
    assert llm.engine.metrics.value("pagoda_block_table_contiguity") == pytest.approx(1.0)
    assert llm.engine.metrics.value("pagoda_block_table_pairs_total") == 0
