"""ThreadedEngine, the step loop on a thread behind the EngineClient protocol: streams, cancellation, failed
steps."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.serving.supervisor import Health
from engine.serving.threaded import ThreadedEngine
from tests.helpers import greedy, random_ids, wait_until


@pytest.fixture
def engine(tiny_dir):
    eng = ThreadedEngine(EngineConfig(model=tiny_dir, dtype="float32"))
    yield eng
    eng.shutdown()


async def collect(eng: ThreadedEngine, prompt, params):
    return [d async for d in eng.generate(prompt, params)]


def test_concurrent_streams_match_offline(engine, tiny_dir):
    prompts = [random_ids(20 + 9 * i, seed=i) for i in range(5)]

    async def main():
        return await asyncio.gather(*(collect(engine, p, greedy(12)) for p in prompts))
    streams = asyncio.run(main())
    offline = LLM(model=tiny_dir, dtype="float32").generate(prompts, greedy(12))
    for deltas, out in zip(streams, offline):
        assert sum((d.token_ids for d in deltas), []) == out.token_ids
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_closing_the_stream_cancels(engine):
    async def main():
        gen = engine.generate(random_ids(30, seed=1), greedy(200))
        async for d in gen:
            if len(d.token_ids) and d.num_output_tokens >= 3:
                break
        await gen.aclose()
        for _ in range(200):
            if engine.engine.metrics.value("pagoda_requests_total", status="cancelled") == 1:
                break
            await asyncio.sleep(0.01)
    asyncio.run(main())
    eng = engine.engine
    assert eng.metrics.value("pagoda_requests_total", status="cancelled") == 1
    assert eng.kv.stats()["used"] == 0


def test_bad_input_raises_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="input_ids: token id 99999"):
            await collect(engine, [1, 99999], greedy(3))
        return await collect(engine, "fine", greedy(3))
    assert asyncio.run(main())[-1].finished


def test_failed_step_ends_requests_and_engine_recovers(engine, monkeypatch):
    runner = engine.engine.runner
    original = runner.forward
    calls = {"n": 0}

    def flaky(rows, prev):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return original(rows, prev)
    monkeypatch.setattr(runner, "forward", flaky)

    async def main():
        return await asyncio.gather(*(collect(engine, random_ids(20, seed=i), greedy(20)) for i in range(2)))
    failed = asyncio.run(main())
    for deltas in failed:
        assert deltas[-1].finished and deltas[-1].finish_reason == "error" and "boom" in deltas[-1].error
    assert engine.engine.kv.stats()["used"] == 0
    again = asyncio.run(collect(engine, random_ids(20, seed=0), greedy(5)))
    assert again[-1].finish_reason == "length"


def test_a_wedged_engine_is_failed_not_left_hanging(tiny_dir):
    """A step fails and so does ending its requests: the engine reports FAILED, says so on submit, and runs its
    on_failed hook (in the engine's child process: exit, so the supervisor starts a new one)."""
    from engine.serving.supervisor import EngineUnavailable
    failed = []
    eng = ThreadedEngine(EngineConfig(model=tiny_dir, dtype="float32"), on_failed=lambda: failed.append(True))

    def broken(*args):
        raise RuntimeError("broken state")
    eng.engine.step = broken
    eng.engine.fail_all = broken
    eng.submit(random_ids(10, seed=1), greedy(5), lambda d: None)
    wait_until(lambda: eng.health is Health.FAILED, "the engine to give up")
    assert failed == [True]
    with pytest.raises(EngineUnavailable, match="failed"):
        eng.submit([5, 6], greedy(2), lambda d: None)
    eng.shutdown()


def test_shutdown_ends_streams(tiny_dir):
    eng = ThreadedEngine(EngineConfig(model=tiny_dir, dtype="float32"))

    async def main():
        gen = eng.generate(random_ids(20, seed=1), greedy(3000))
        first = await gen.__anext__()
        eng.shutdown()
        rest = [d async for d in gen]
        return first, rest
    first, rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "error" and "shut down" in rest[-1].error
    assert eng.health is Health.STOPPED


def test_submit_pushes_deltas_on_the_engine_thread_and_forgets_finished_streams(engine, tiny_dir):
    import queue
    import threading
    got: queue.SimpleQueue = queue.SimpleQueue()
    prompt = random_ids(30, seed=7)
    rid = engine.submit(prompt, greedy(9), lambda d: got.put((threading.current_thread().name, d)))
    deltas = []
    while not deltas or not deltas[-1].finished:
        thread, d = got.get(timeout=30)
        assert thread == "pagoda-engine" and d.request_id == rid
        deltas.append(d)
    offline = LLM(model=tiny_dir, dtype="float32").generate([prompt], greedy(9))[0]
    assert sum((d.token_ids for d in deltas), []) == offline.token_ids
    assert rid not in engine.streams
    with pytest.raises(ValueError, match="input_ids"):
        engine.submit([10 ** 9], greedy(2), got.put)


def test_make_client_places_the_step_loop(tiny_dir):
    from engine.serving.client import EngineClient, make_client
    from engine.serving.threaded import ThreadedEngine
    client = make_client(EngineConfig(model=tiny_dir, dtype="float32", engine_process=False))
    try:
        assert isinstance(client, ThreadedEngine) and isinstance(client, EngineClient)
        assert client.config.model == tiny_dir and client.metrics is client.engine.metrics
    finally:
        client.shutdown()
