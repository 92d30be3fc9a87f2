"""The lookahead state machine: pipelined ticks, the kill switch, unwinding, and sync-identical cache state."""
from __future__ import annotations

import pytest

from engine import LLM
from engine.config import EngineConfig
from tests.helpers import greedy, random_ids, step


def test_512_token_request_pipelines(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    out = llm.generate(random_ids(20, seed=1), greedy(512))[0]
    assert len(out.token_ids) == 512
    m = llm.engine.metrics
    assert m.value("pagoda_decode_lookahead_steps_total") >= 509
    assert m.value("pagoda_decode_steps_total") == 511
    assert m.value("pagoda_lookahead_unwinds_total") == 0     # max_tokens is known ahead: nothing speculative


def test_kill_switch(tiny_dir, monkeypatch):
    monkeypatch.setenv("PAGODA_FORCE_SYNC", "1")
    assert not EngineConfig(model=tiny_dir).use_lookahead
    llm = LLM(model=tiny_dir, dtype="float32")
    llm.generate(random_ids(20, seed=1), greedy(512))
    assert llm.engine.metrics.value("pagoda_decode_lookahead_steps_total") == 0
    assert llm.engine.lookahead.state == "idle"


def stop_case(tiny_dir, at: int) -> tuple[list[int], int, list[int]]:
    """A prompt whose greedy output first produces some token at index >= `at`: (prompt, token, output to it)."""
    llm = LLM(model=tiny_dir, dtype="float32", lookahead=False)
    for seed in range(50):
        prompt = random_ids(50, seed=seed)
        ids = llm.generate(prompt, greedy(40))[0].token_ids
        fresh = [i for i in range(at, 40) if ids[i] not in ids[:i]]
        if fresh:
            return prompt, ids[fresh[0]], ids[:fresh[0] + 1]
    raise AssertionError("no prompt with a fresh token to stop on")


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_unwind_when_a_row_stops_with_a_step_in_flight(tiny_dir, storage):
    prompt, token, expected = stop_case(tiny_dir, at=6)
    results = {}
    for lookahead in (True, False):
        llm = LLM(model=tiny_dir, dtype="float32", kv_storage=storage, lookahead=lookahead)
        other = random_ids(30, seed=6)
        outs = llm.generate([prompt, other], [greedy(40, stop_token_ids=[token], ignore_eos=False), greedy(25)])
        assert outs[0].token_ids == expected
        assert outs[0].finish_reason == "stop"
        eng = llm.engine
        unwinds = eng.metrics.value("pagoda_lookahead_unwinds_total")
        stopping_other = outs[1].finish_reason == "stop"
        assert unwinds == (0 if not lookahead else 1 + stopping_other)
        results[lookahead] = (eng.kv.stats(), sorted((e.parent, e.tokens) for e in eng.kv.cache.content.values())
                              if storage == "paged" else sorted(e[0] for e in eng.kv.store.entries.values()))
    assert results[True] == results[False]       # the cache after unwinding is the synchronous path's


def test_state_transitions(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    eng = llm.engine
    req = eng.add(eng.make_request(random_ids(10, seed=2), greedy(6)))
    states = []
    while eng.has_work:
        eng.step()
        states.append(eng.lookahead.state)
    assert states[0] == "primed"          # prefill, then the first decode step launched with nothing before it
    assert "steady" in states
    assert states[-1] == "idle"
    assert len(req.output_ids) == 6
    assert req.num_allocated == req.num_computed == 15


def test_cancel_with_step_in_flight(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    eng = llm.engine
    req = eng.add(eng.make_request(random_ids(10, seed=2), greedy(100)))
    for _ in range(5):
        eng.step()
    assert req.in_flight == 1
    eng.abort(req.id)
    deltas = step(eng)
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert eng.kv.stats()["used"] == 0
    assert eng.metrics.value("pagoda_requests_total", status="cancelled") == 1


def test_in_order_only_when_every_input_is_the_same_rows_previous_token():
    from engine.runners.base import Row, flatten, in_order
    steady = [Row(0, 40, [], prev=0), Row(1, 50, [], prev=1)]
    assert in_order(flatten(steady)[2], 2)
    assert not in_order(flatten([Row(0, 40, [], prev=1), Row(1, 50, [], prev=0)])[2], 2)   # rows reordered
    assert not in_order(flatten([Row(0, 40, [], prev=0), Row(1, 50, [7])])[2], 2)          # a row from the host
