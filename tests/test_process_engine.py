"""ProcessEngine: the step loop in a child process, behind the EngineClient protocol. Its streams match the
in-process engine's; bad input is refused before streaming; an abort frees the child's KV; metrics and log lines
come across; a child that dies or is shut down ends every stream with an error, and a dead child is restarted
unless it keeps dying."""
from __future__ import annotations

import asyncio
import logging
import queue
import signal
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.serving.metrics import Metrics
from engine.serving.process import ProcessEngine
from engine.serving.supervisor import EngineUnavailable, Health, Restarts
from tests.helpers import greedy, random_ids, wait_until


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = ProcessEngine(EngineConfig(model=tiny_dir, dtype="float32", num_threads=1))
    yield eng
    eng.shutdown()


def run(eng: ProcessEngine, prompt, params: SamplingParams, stop_after: int | None = None):
    """(deltas, thread names that pushed them) of one request; aborts it after `stop_after` deltas."""
    got: queue.SimpleQueue = queue.SimpleQueue()
    rid = eng.submit(prompt, params, lambda d: got.put((threading.current_thread().name, d)))
    deltas, threads = [], set()
    while not deltas or not deltas[-1].finished:
        thread, d = got.get(timeout=60)
        assert d.request_id == rid
        deltas.append(d)
        threads.add(thread)
        if stop_after is not None and len(deltas) == stop_after:
            eng.abort(rid)
    return deltas, threads


def test_streams_match_the_in_process_engine(engine, tiny_dir):
    prompts = [random_ids(20 + 9 * i, seed=i) for i in range(3)]
    offline = LLM(model=tiny_dir, dtype="float32").generate(prompts, greedy(12))
    for prompt, out in zip(prompts, offline):
        deltas, threads = run(engine, prompt, greedy(12))
        assert sum((d.token_ids for d in deltas), []) == out.token_ids
        assert "".join(d.text for d in deltas) == out.text
        assert deltas[-1].finish_reason == "length" and threads == {"pagoda-engine-link"}
    assert engine.proc.pid != threading.get_native_id() and engine.proc.poll() is None


def test_generate_streams_concurrently(engine, tiny_dir):
    prompts = [random_ids(25, seed=10 + i) for i in range(3)]

    async def main():
        async def one(p):
            return [d async for d in engine.generate(p, greedy(8))]
        return await asyncio.gather(*(one(p) for p in prompts))
    offline = LLM(model=tiny_dir, dtype="float32").generate(prompts, greedy(8))
    for deltas, out in zip(asyncio.run(main()), offline):
        assert sum((d.token_ids for d in deltas), []) == out.token_ids


def test_bad_input_is_refused_before_streaming_naming_the_field(engine):
    with pytest.raises(ValueError, match="input_ids: must not be empty"):
        engine.submit([], greedy(3), lambda d: None)
    with pytest.raises(ValueError, match="max_tokens: prompt"):
        engine.submit([5, 6], greedy(10 ** 6), lambda d: None)
    assert not engine.streams and not engine.waiting
    deltas, _ = run(engine, [5, 6, 7], greedy(3))          # and it serves on
    assert deltas[-1].finish_reason == "length"


def test_abort_frees_the_childs_blocks_and_metrics_come_across(engine):
    before = engine.metrics.value("pagoda_requests_total", status="cancelled")
    tokens = engine.metrics.value("pagoda_generation_tokens_total")
    deltas, _ = run(engine, random_ids(40, seed=21), greedy(3000), stop_after=3)
    assert deltas[-1].finish_reason == "abort" and len(deltas) < 3000
    # the child sends its metrics just before a final delta, so they are current when the delta lands
    assert engine.metrics.value("pagoda_requests_total", status="cancelled") == before + 1
    assert engine.metrics.value("pagoda_kv_blocks", state="used") == 0
    assert engine.metrics.value("pagoda_generation_tokens_total") >= tokens + 3
    assert engine.metrics.value("pagoda_e2e_request_latency_seconds_count") >= 1


def test_log_lines_come_across(engine, caplog):
    with caplog.at_level(logging.INFO, logger="pagoda"):
        run(engine, random_ids(10, seed=30), greedy(4))
    assert any("request completed cached=0/10" in r.getMessage() for r in caplog.records)


def test_shutdown_ends_running_streams_and_the_child_exits(tiny_dir):
    eng = ProcessEngine(EngineConfig(model=tiny_dir, dtype="float32", num_threads=1))
    got: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(random_ids(20, seed=1), greedy(3000), got.put)
    got.get(timeout=60)
    eng.shutdown()
    last = got.get(timeout=10)
    while not last.finished:
        last = got.get(timeout=10)
    assert last.finish_reason == "error" and "shut down" in last.error
    assert eng.proc.returncode == 0
    assert eng.health is Health.STOPPED         # on purpose: not a crash loop's FAILED
    with pytest.raises(EngineUnavailable, match="shut down"):
        eng.submit([5, 6], greedy(2), got.put)


def test_a_child_that_dies_is_restarted_and_serves_again(tiny_dir):
    """SIGKILL (the OOM killer): the open stream ends with an error, submits meanwhile are EngineUnavailable at
    once, a new child serves the same greedy output, the restart is counted and no block is held."""
    eng = ProcessEngine(EngineConfig(model=tiny_dir, dtype="float32", num_threads=1))
    prompt = random_ids(20, seed=2)
    want = collect(eng, prompt, greedy(6))
    got: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(prompt, greedy(3000), got.put)
    got.get(timeout=60)
    first = eng.proc.pid
    eng.proc.send_signal(signal.SIGKILL)
    last = got.get(timeout=10)
    while not last.finished:
        last = got.get(timeout=10)
    assert last.finish_reason == "error" and "engine process exited (code -9)" in last.error
    if eng.health is Health.RESTARTING:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="restarting after the engine process exited"):
            eng.submit([5, 6], greedy(2), got.put)
        assert time.monotonic() - started < 1.0                 # refused at once, not after a wait
    wait_until(lambda: eng.health is Health.UP, "the engine to come back", timeout=60)
    assert eng.proc.pid != first and collect(eng, prompt, greedy(6)) == want
    assert eng.metrics.value("pagoda_engine_restarts_total") == 1
    assert eng.metrics.value("pagoda_kv_blocks", state="used") == 0 and not eng.waiting and not eng.streams
    eng.shutdown()


def test_a_crash_loop_ends_the_restarts(tiny_dir):
    eng = ProcessEngine(EngineConfig(model=tiny_dir, dtype="float32", num_threads=1, restart_limit=2))
    eng.proc.kill()
    wait_until(lambda: eng.health is Health.UP and eng.proc.poll() is None and
               eng.metrics.value("pagoda_engine_restarts_total") == 1, "the first restart", timeout=60)
    eng.proc.kill()                                             # the second death within the window
    wait_until(lambda: eng.health is Health.FAILED, "the supervisor to give up", timeout=60)
    with pytest.raises(EngineUnavailable, match="died 2 times within 60 s; not restarting"):
        eng.submit([5, 6], greedy(2), lambda d: None)
    eng.shutdown()


def collect(eng: ProcessEngine, prompt: list[int], params) -> list[int]:
    got: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(prompt, params, got.put)
    ids, d = [], got.get(timeout=60)
    ids += d.token_ids
    while not d.finished:
        d = got.get(timeout=60)
        ids += d.token_ids
    return ids
    eng.shutdown()


def test_a_child_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="engine process: ValueError: model: .*missing has no config.json"):
        ProcessEngine(EngineConfig(model=str(tmp_path / "missing")))


def test_metrics_apply_brings_a_registry_to_a_snapshot_once():
    child, parent = Metrics(), Metrics()
    child.requests.labels(status="completed").inc(3)
    child.kv_blocks.labels(state="used").set(7)
    child.observe("pagoda_time_to_first_token_seconds", 0.02)
    snap = child.snapshot()
    parent.apply(snap)
    parent.apply(child.snapshot())                      # applying again adds nothing: counters go by difference
    assert parent.value("pagoda_requests_total", status="completed") == 3
    assert parent.value("pagoda_kv_blocks", state="used") == 7
    assert parent.value("pagoda_time_to_first_token_seconds_count") == 1
    assert list(parent.observations) == [("pagoda_time_to_first_token_seconds", 0.02)]   # for a Mirror to replay
    child.requests.labels(status="completed").inc()
    child.kv_blocks.labels(state="used").set(0)
    parent.apply(child.snapshot())
    assert parent.value("pagoda_requests_total", status="completed") == 4
    assert parent.value("pagoda_kv_blocks", state="used") == 0


def test_restarts_back_off_and_stop_in_a_crash_loop():
    r = Restarts(limit=3, window=60, base=0.5, cap=1.5)
    assert [r.died(t) for t in (0, 1, 100, 101)] == [0.5, 1.0, 0.5, 1.0]     # the window forgets old deaths
    assert r.died(102) is None                                               # the third within a minute
