"""Every block returns to the pool (finish, cancel, preempt), and no shared block is ever written."""
from __future__ import annotations

import pytest

from engine import LLM
from engine.kernels import reference as ref
from tests.helpers import greedy, random_ids, step


@pytest.fixture
def write_guard(monkeypatch):
    """Checks, at the actual KV write, that every slot written lies in a block with ref count 1."""
    pools, writes = [], []
    original = ref.write_kv

    def checked(k_cache, v_cache, slots, k, v):
        bs = k_cache.shape[1]
        for pool in pools:
            for s in slots.tolist():
                assert pool.ref[s // bs] == 1, f"write into block {s // bs} with ref {pool.ref[s // bs]}"
        writes.append(len(slots))
        original(k_cache, v_cache, slots, k, v)
    monkeypatch.setattr(ref, "write_kv", checked)
    return pools, writes


def make(tiny_dir, pools=None, **kw) -> LLM:
    llm = LLM(model=tiny_dir, dtype="float32", kv_storage="paged", **kw)
    if pools is not None:
        pools.append(llm.engine.pool)
    return llm



def test_shared_prefix_blocks_are_never_written(tiny_dir, write_guard):
    pools, writes = write_guard
    llm = make(tiny_dir, pools, block_size=16)
    prefix = random_ids(96, seed=1)
    llm.generate(prefix + [5], greedy(4))
    prompts = [prefix + random_ids(10 + i, seed=20 + i) for i in range(4)] + [prefix + [5]] * 2
    outs = llm.generate(prompts, greedy(20))
    assert [o.cached_tokens for o in outs] == [96] * 6
    assert max(llm.engine.pool.ref) == 0 and writes
    assert llm.engine.kv.stats()["used"] == 0


def test_blocks_return_after_finish(tiny_dir):
    llm = make(tiny_dir, prompt_cache=False)
    total = llm.engine.pool.num_blocks
    llm.generate([random_ids(70 + i, seed=i) for i in range(6)], greedy(33))
    assert llm.engine.pool.num_free == total
    cached = make(tiny_dir)
    cached.generate([random_ids(70 + i, seed=i) for i in range(6)], greedy(33))
    stats = cached.engine.kv.stats()
    assert stats["used"] == 0 and stats["cached"] > 0
    assert stats["free"] + stats["cached"] == cached.engine.pool.num_blocks


@pytest.mark.parametrize("stage", ["queued", "mid-prefill", "first-token", "mid-decode"])
def test_cancel_returns_every_block(tiny_dir, stage):
    llm = make(tiny_dir, max_batch_size=2, prefill_chunk=16, prompt_cache=False)
    eng = llm.engine
    total = eng.pool.num_blocks
    reqs = [eng.add(eng.make_request(random_ids(60, seed=i), greedy(50))) for i in range(3)]
    target = {"queued": reqs[2], "mid-prefill": reqs[0], "first-token": reqs[0], "mid-decode": reqs[1]}[stage]
    ticks = {"queued": 1, "mid-prefill": 1, "first-token": 4, "mid-decode": 12}[stage]
    for _ in range(ticks):
        eng.step()
    if stage == "mid-prefill":
        assert target.prefilling and target.num_computed > 0
    if stage == "first-token":
        assert len(target.output_ids) == 1
    eng.abort(target.id)
    finals = []
    while eng.has_work:
        finals += [d for d in step(eng) if d.finished]
    assert {d.request_id: d.finish_reason for d in finals}[target.id] == "abort"
    assert eng.pool.num_free == total
    assert eng.metrics.value("pagoda_requests_total", status="cancelled") == 1
    assert llm.generate(random_ids(60, seed=0), greedy(50))[0].token_ids == \
        make(tiny_dir).generate(random_ids(60, seed=0), greedy(50))[0].token_ids


def test_preemption_recomputes_to_identical_tokens(tiny_dir, write_guard):
    pools, _ = write_guard
    prompts = [random_ids(40 + 7 * i, seed=30 + i) for i in range(4)]
    alone = [make(tiny_dir).generate(p, greedy(60))[0].token_ids for p in prompts]
    llm = make(tiny_dir, pools, block_size=16, num_kv_blocks=16)
    outs = llm.generate(prompts, greedy(60))
    assert llm.engine.metrics.value("pagoda_preemptions_total") > 0
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.kv.stats()["used"] == 0


def test_request_larger_than_pool(tiny_dir):
    llm = make(tiny_dir, block_size=16, num_kv_blocks=4)
    with pytest.raises(ValueError, match="input_ids: 80 tokens need more KV blocks than the pool holds"):
        llm.generate(random_ids(80, seed=1), greedy(4))
    out = llm.generate(random_ids(40, seed=1), greedy(100))[0]     # fits to start, outgrows the pool while decoding
    assert out.finish_reason == "error" and "kv cache" in out.error
    assert llm.engine.pool.num_free + llm.engine.pool.num_cached == 4


def test_gauges_are_fresh_when_the_final_delta_goes_out(tiny_dir):
    """Front ends scrape right after a request ends: its blocks must already show as released."""
    llm = make(tiny_dir, prompt_cache=False)
    eng = llm.engine
    seen = []
    eng.on_delta = lambda d: d.finished and seen.append(eng.metrics.value("pagoda_kv_blocks", state="used"))
    eng.add(eng.make_request(random_ids(70, seed=1), greedy(5)))
    while eng.has_work:
        eng.step()
    assert seen == [0]
