"""Parallel sampling (n > 1): the prompt is prefilled once, the sequences fork its KV (full blocks shared by
reference, the partial tail copied on first write), each samples with its own state (seed + index, as vLLM), and
every block returns however the sequences end."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.output import Delta
from tests.helpers import greedy, random_ids, step
from tests.test_kv_lifecycle import write_guard  # noqa: F401  (a fixture)


def sampled(n: int, seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(**{"n": n, "max_tokens": 12, "temperature": 1.0, "seed": seed, "ignore_eos": True, **kw})


@pytest.mark.parametrize("kv_storage", ["paged", "dense"])
def test_n_sequences_prefill_once_and_match_their_seeds(tiny_dir, kv_storage, write_guard):  # noqa: F811
    pools, _ = write_guard
    llm = LLM(model=tiny_dir, dtype="float32", kv_storage=kv_storage, max_batch_size=4)
    pools.extend([llm.engine.pool] if llm.engine.pool else [])
    prompt = random_ids(45, seed=3)                  # 45 = one full block of 32 + a partial tail: shared, then copied
    computed = llm.engine.runner.tokens_computed
    out = llm.generate(prompt, sampled(3, seed=11))[0]
    # one prefill of the prompt's first 44 positions, then 3 sequences x 12 decode positions
    assert llm.engine.runner.tokens_computed - computed == 44 + 3 * 12
    assert [o.index for o in out.outputs] == [0, 1, 2] and len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in out.outputs)
    for i, seq in enumerate(out.outputs):            # sequence i samples as a lone request seeded seed + i
        alone = llm.generate(prompt, sampled(1, seed=11 + i))[0]
        assert seq.token_ids == alone.token_ids and seq.text == alone.text
    assert llm.generate(prompt, sampled(3, seed=11))[0].outputs == out.outputs     # reproducible
    if kv_storage == "paged":
        assert llm.engine.kv.copies >= 2 and llm.engine.kv.stats()["used"] == 0


def test_greedy_sequences_equal_the_single_greedy_output(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_batch_size=4)
    prompt = random_ids(65, seed=5)                  # 64 positions prefilled, two whole blocks: no tail to copy
    want = llm.generate(prompt, greedy(20))[0].token_ids
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [want] * 4 and llm.engine.kv.copies == 0


def test_n_is_checked(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_batch_size=2)
    with pytest.raises(ValueError, match="^n: 3 sequences exceed max_batch_size"):
        llm.generate([5, 6, 7], SamplingParams(n=3))
    with pytest.raises(ValueError, match="^n: must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="^n: expected an integer"):
        SamplingParams.from_dict({"n": "two"})
    assert SamplingParams.from_dict({"n": "2"}).n == 2


def test_streamed_deltas_name_their_sequence_and_the_last_one_finishes(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_batch_size=4)
    engine = llm.engine
    req = engine.add(engine.make_request(random_ids(40, seed=1), sampled(3, seed=2, max_tokens=5)))
    deltas: list[Delta] = []
    while engine.has_work:
        deltas += step(engine)
    assert {d.request_id for d in deltas} == {req.id}
    assert sorted({d.index for d in deltas}) == [0, 1, 2]
    ends = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in ends) == [0, 1, 2] and [d.finished for d in deltas].count(True) == 1
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 15


def test_cancel_ends_every_sequence_and_frees_their_blocks(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_batch_size=4)
    engine = llm.engine
    req = engine.add(engine.make_request(random_ids(50, seed=9), sampled(3, seed=1, max_tokens=200)))
    deltas: list[Delta] = []
    while sum(len(d.token_ids) for d in deltas) < 9:
        deltas += step(engine)
    engine.abort(req.id)
    while engine.has_work:
        deltas += step(engine)
    ends = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert ends == {0: "abort", 1: "abort", 2: "abort"} and deltas[-1].finished
    assert engine.kv.stats()["used"] == 0 and max(engine.pool.ref) == 0


def test_forks_finish_in_any_order_with_cancels_and_preemption(tiny_dir, write_guard):  # noqa: F811
    """Random mixes of n = 1..3 requests with different lengths and stop tokens on a pool small enough to preempt,
    some cancelled at a random step (before the fork, mid-prefill, mid-decode): every request ends once, every
    sequence gets its final delta, and every block returns."""
    pools, _ = write_guard
    seen = [_mix(tiny_dir, seed, pools) for seed in range(6)]
    assert sum(p for p, _ in seen) > 0 and all(c > 0 for _, c in seen)     # the mixes did preempt and copy


def _mix(tiny_dir, seed: int, pools: list) -> tuple[float, int]:
    rng = random.Random(seed)
    llm = LLM(model=tiny_dir, dtype="float32", kv_storage="paged", max_batch_size=4, block_size=16,
              num_kv_blocks=10, prefill_chunk=48, lookahead=rng.random() < 0.7)
    engine = llm.engine
    pools[:] = [engine.pool]            # the write guard checks this engine's pool
    reqs, cancel_at = [], {}
    for i in range(7):
        n = rng.randint(1, 3)
        params = SamplingParams(n=n, max_tokens=rng.randint(1, 60), temperature=rng.choice([0.0, 1.0]),
                                seed=rng.randint(0, 99), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=rng.sample(range(3, 900), 30))
        req = engine.add(engine.make_request(random_ids(rng.randint(1, 70), seed=seed * 10 + i), params))
        reqs.append(req)
        if rng.random() < 0.4:
            cancel_at[req.id] = rng.randint(0, 30)
    deltas: list[Delta] = []
    ticks = 0
    while engine.has_work:
        for rid, at in cancel_at.items():
            if at == ticks:
                engine.abort(rid)
        deltas += step(engine)
        ticks += 1
    for req in reqs:
        mine = [d for d in deltas if d.request_id == req.id]
        assert [d.finished for d in mine].count(True) == 1 and mine[-1].finished
        assert sorted(d.index for d in mine if d.finish_reason) == list(range(len(req.group or [req])))
        assert all(d.finish_reason != "error" for d in mine)
    assert engine.kv.stats()["used"] == 0 and max(engine.pool.ref) == 0
    assert not engine.requests and not engine.forking
    return engine.metrics.value("pagoda_preemptions_total"), engine.kv.copies
