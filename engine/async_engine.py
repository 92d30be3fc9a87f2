"""AsyncEngine: the step loop on a background thread; `generate` is an async iterator of deltas."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.engine import Delta, Engine
from engine.metrics import Metrics
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import QueueFull
from engine.tokenizer import Tokenizer

log = logging.getLogger("pagoda")


class Streaming:
    """`generate`, an async iterator of deltas, for an engine with `submit(prompt, params, push) -> id`,
    `abort(id)` and its `streams` by id: AsyncEngine, and EngineProcess with its step loop in a child process."""
    streams: dict[int, Callable[[Delta], None]]

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """Stream deltas of one request; raises ValueError (naming the field) before the first delta on bad input.
        Closing the iterator early cancels the request."""
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request_id = self.submit(prompt, params, lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d))
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)
            self.streams.pop(request_id, None)


class AsyncEngine(Streaming):
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config)
        self.engine.on_delta = lambda d: self._deliver([d])
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.streams: dict[int, Callable[[Delta], None]] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="pagoda-engine", daemon=True)
        self.thread.start()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def submit(self, prompt: str | list[int], params: SamplingParams | None,
               push: Callable[[Delta], None], request_id: int | None = None) -> int:
        """Queue a request whose deltas `push` receives on the engine thread (it must not block); returns its id
        (`request_id` when given). Raises ValueError (naming the field) on bad input."""
        if self.stopping:
            raise RuntimeError("engine: shutting down")
        req = self.engine.make_request(prompt, params, request_id)
        self.streams[req.id] = push
        self.inbox.put(req)
        self.wake.set()
        return req.id

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self.wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running end with an error delta."""
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout)

    def _loop(self) -> None:
        engine = self.engine
        while not self.stopping:
            self._take_inbox()
            if not engine.has_work:
                self.wake.wait()
                self.wake.clear()
                continue
            try:
                deltas = engine.step()
            except Exception as e:      # a failed step ends every request in flight; the engine serves on
                log.exception("engine step failed")
                deltas = engine.fail_all(f"engine: step failed: {e}")
            self._deliver(deltas)
        self._take_inbox()
        self._deliver(engine.fail_all("engine: shut down"))

    def _take_inbox(self) -> None:
        while True:
            try:
                req = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine.add(req)
            except QueueFull as e:
                self._deliver([Delta(req.id, [], "", True, "error", str(e), len(req.prompt_ids))])

    def _deliver(self, deltas: list[Delta]) -> None:
        for d in deltas:
            push = self.streams.get(d.request_id)
            if push is not None:
                if d.finished:
                    del self.streams[d.request_id]
                push(d)
