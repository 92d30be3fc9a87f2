"""ThreadedEngine: the step loop on a background thread of this process."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.admission import Overloaded
from engine.core.engine import Engine
from engine.core.output import Delta
from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.serving.client import EngineClient, Push
from engine.serving.metrics import Metrics
from engine.serving.supervisor import EngineUnavailable, Health
from engine.tokenizer import Tokenizer

log = logging.getLogger("pagoda")


class ThreadedEngine(EngineClient):
    """A failed step ends every request in flight and the engine serves on; if even that fails, the engine is
    FAILED (`on_failed` runs: the engine's child process exits, so its supervisor starts a new one)."""

    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None,
                 on_failed: Callable[[], None] | None = None) -> None:
        self.engine = engine or Engine(config)
        self.on_failed = on_failed
        self.health, self.why = Health.UP, ""
        self.engine.on_delta = self._deliver
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.admitting = threading.Lock()   # a request moves from the inbox to the queue in one piece
        self.streams: dict[int, Push] = {}
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

    def submit(self, prompt: str | list[int], params: SamplingParams | None, push: Push,
               request_id: int | None = None) -> int:
        if self.stopping or self.health is not Health.UP:
            raise EngineUnavailable("engine: shutting down" if self.stopping else self.why)
        req = self.engine.make_request(prompt, params, request_id)
        with self.admitting:                # the queue's length counts what the inbox holds too
            waiting = len(self.engine.scheduler.waiting) + self.inbox.qsize()
            try:
                self.engine.admission.check(waiting, time.monotonic())  # refused before any output
            except Overloaded:
                self.metrics.requests.labels(status="refused").inc()
                raise
            self.streams[req.id] = push
            self.inbox.put(req)
        self.wake.set()
        return req.id

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self.wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
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
                engine.step()
            except Exception as e:      # a failed step ends every request in flight; the engine serves on
                log.exception("engine step failed")
                try:
                    engine.fail_all(f"engine: step failed: {e}")
                except Exception:
                    log.exception("engine: could not end the requests of a failed step: the engine is wedged")
                    self.health, self.why = Health.FAILED, "engine: failed (wedged after a failed step), see the log"
                    if self.on_failed is not None:
                        self.on_failed()
                    return
        self._take_inbox()
        self.health, self.why = Health.STOPPED, "engine: shut down"     # a wedged engine returned above
        engine.fail_all("engine: shut down")

    def _take_inbox(self) -> None:
        while True:
            with self.admitting:
                try:
                    req = self.inbox.get_nowait()
                except queue.Empty:
                    return
                self.engine.add(req)

    def _deliver(self, d: Delta) -> None:
        push = self.streams.pop(d.request_id, None) if d.finished else self.streams.get(d.request_id)
        if push is not None:
            push(d)
