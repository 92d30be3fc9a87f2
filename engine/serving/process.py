"""ProcessEngine: the step loop in a child process; the messages it exchanges are in serving/messages.py.

A front end that does Python work for every token (the Triton model builds and sends a response per token) shares
the GIL with an engine thread in its own process, and each hand-off of the GIL stalls the engine until the other
thread is scheduled (docs/serving-triton.md). In its own process the engine only pickles each delta into a pipe.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig
from engine.core.admission import Overloaded
from engine.core.output import Delta
from engine.core.sampling import SamplingParams
from engine.serving import messages as m
from engine.serving.client import EngineClient, Push
from engine.serving.metrics import Metrics
from engine.serving.supervisor import EngineUnavailable, Health, Restarts
from engine.serving.threaded import ThreadedEngine
from engine.tokenizer import Tokenizer

log = logging.getLogger("pagoda")


def python_executable() -> str:
    """The interpreter the child runs on: inside Triton's Python-backend stub, sys.executable is the stub."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python"):
        return exe
    return shutil.which("python3") or exe


@dataclass(slots=True)
class _Pending:
    """The child's answer to one Add, once it came."""
    done: threading.Event = field(default_factory=threading.Event)
    answer: m.Answer | None = None


@dataclass(slots=True, eq=False)
class _Child:
    """One engine process and the parent's end of its socket."""
    proc: subprocess.Popen
    conn: Connection


def _spawn(config: EngineConfig) -> tuple[_Child, m.Started, m.MetricsSnapshot | None]:
    # A plain `python -m` child on a socket pair, not multiprocessing's spawn: that re-imports the parent's
    # __main__, which fails in scripts without a main guard and means nothing inside Triton's stub. Its own
    # session: a Ctrl-C at the terminal reaches the parent, which stops the child in order.
    ours, theirs = socket.socketpair()
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([python_executable(), "-m", "engine.serving.process", str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), env={**os.environ, "PYTHONPATH": path},
                            start_new_session=True)
    theirs.close()
    child = _Child(proc, Connection(ours.detach()))
    try:
        child.conn.send(m.Start(config))
        started = child.conn.recv()
        while isinstance(started, m.Log):       # what the engine logged while it started
            log.log(started.level, started.text)
            started = child.conn.recv()
        first = child.conn.recv() if started.config is not None else None   # a snapshot right after Started
    except (EOFError, OSError):
        started, first = m.Started(None, f"exited with code {proc.wait()}"), None
    return child, started, first


class ProcessEngine(EngineClient):
    """Supervises its child: when the child dies, the requests it held end with an error, and a new child is
    started after a backoff (serving/supervisor.py); meanwhile submits raise EngineUnavailable at once. A crash
    loop leaves it FAILED for good."""

    def __init__(self, config: EngineConfig) -> None:
        child, started, first = _spawn(config)
        if started.config is None:
            raise RuntimeError(f"engine process: {started.error}")
        self.config: EngineConfig = started.config
        self.metrics = Metrics(self.config.model_name)      # the child's, as of its last snapshot
        self.metrics.apply(first.snapshot)
        self.streams: dict[int, Push] = {}
        self.waiting: dict[int, _Pending] = {}       # submits awaiting the child's validation
        self.ids = itertools.count()
        self.send_lock = threading.Lock()
        self.restarts = Restarts(config.restart_limit, config.restart_window, config.restart_delay_ms / 1000)
        self.health, self.why = Health.UP, ""
        self.stopping = False
        self._adopt(child)
        log.info("pagoda: the step loop runs in process %d", child.proc.pid)

    @property
    def running(self) -> bool:
        return self.health is Health.UP

    @property
    def proc(self) -> subprocess.Popen:
        return self.child.proc

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.config.tokenizer or self.config.model)

    def submit(self, prompt: str | list[int], params: SamplingParams | None, push: Push,
               request_id: int | None = None) -> int:
        """`push` runs on this process's reader thread. Waits for the child's validation."""
        if self.health is not Health.UP:
            raise EngineUnavailable(self.why)
        rid = next(self.ids) if request_id is None else request_id
        pending = self.waiting[rid] = _Pending()
        self.streams[rid] = push
        reader = self.reader
        self._send(m.Add(rid, prompt, params))
        while not pending.done.wait(0.05) and reader.is_alive() and self.health is Health.UP:
            pass                                        # a child that died before answering: not UP any more
        del self.waiting[rid]
        if pending.answer is None:
            self.streams.pop(rid, None)
            raise EngineUnavailable(self.why or "engine: the engine process exited")
        answer = pending.answer
        if answer.error:
            self.streams.pop(rid, None)
            if answer.kind == "Overloaded":
                raise Overloaded(answer.error, answer.retry_after)
            raise (ValueError if answer.kind == "ValueError" else RuntimeError)(answer.error)
        return rid

    def abort(self, request_id: int) -> None:
        if self.health is Health.UP:
            self._send(m.Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self.health is Health.UP:
            self._send(m.Stop())
        self.reader.join(timeout)
        try:
            self.child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.child.proc.kill()
            self.child.proc.wait(timeout)

    def _adopt(self, child: _Child) -> None:
        self.child = child
        self.reader = threading.Thread(target=self._read, args=(child,), name="pagoda-engine-link", daemon=True)
        self.reader.start()

    def _send(self, message: object) -> None:
        try:
            with self.send_lock:
                self.child.conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            pass                                    # the reader sees the child gone and fails its streams

    def _read(self, child: _Child) -> None:
        while True:
            try:
                message = child.conn.recv()
            except (EOFError, OSError):
                break
            match message:
                case Delta(request_id=rid, finished=finished):
                    push = self.streams.pop(rid, None) if finished else self.streams.get(rid)
                    if push is not None:
                        push(message)
                case m.MetricsSnapshot(snapshot=snapshot):
                    self.metrics.apply(snapshot)
                case m.Log(level=level, text=text):
                    log.log(level, "%s", text)
                case m.Answer(request_id=rid):
                    pending = self.waiting.get(rid)
                    if pending is not None:
                        pending.answer = message
                        pending.done.set()
        self._child_gone(child)

    def _child_gone(self, child: _Child) -> None:
        try:
            code = child.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        if not self.stopping:
            self.health, self.why = Health.RESTARTING, f"engine: restarting after the engine process exited " \
                                                       f"(code {code}); retry shortly"
        for rid, pending in list(self.waiting.items()):
            if pending.answer is None:              # its submit raises EngineUnavailable: no delta for it too
                self.streams.pop(rid, None)
            pending.done.set()
        for rid, push in list(self.streams.items()):
            del self.streams[rid]
            push(Delta(rid, [], "", True, "error", f"engine: the engine process exited (code {code})"))
        if self.stopping:
            self.health, self.why = Health.STOPPED, "engine: shut down"
            return
        log.error("pagoda: the engine process exited (code %s)", code)
        self._restart()

    def _restart(self) -> None:
        """On the dead child's reader thread: wait out the backoff, start a new child, adopt it."""
        while not self.stopping:
            wait = self.restarts.died(time.monotonic())
            if wait is None:
                self.health = Health.FAILED
                self.why = (f"engine: the engine process died {self.restarts.limit} times within "
                            f"{self.restarts.window:g} s; not restarting it (a crash loop: replace this replica)")
                log.error("pagoda: %s", self.why)
                return
            time.sleep(wait)
            child, started, first = _spawn(self.config)
            if self.stopping:                       # shut down meanwhile: the new child goes too
                if started.config is not None:
                    child.conn.send(m.Stop())
                child.proc.wait(30)
                return
            if started.config is not None:
                self.metrics.restarted()
                self.metrics.apply(first.snapshot)
                self._adopt(child)
                self.health, self.why = Health.UP, ""
                log.info("pagoda: engine restarted: process %d", child.proc.pid)
                return
            log.error("pagoda: the engine process did not start again: %s", started.error)


class _PipeLog(logging.Handler):
    def __init__(self, send) -> None:
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        self.send(m.Log(record.levelno, self.format(record)))


def serve(conn: Connection) -> None:
    """The child: a ThreadedEngine on the config of the parent's Start, whose deltas, log lines and metrics go up
    the pipe."""
    start: m.Start = conn.recv()
    lock = threading.Lock()

    def send(message: object) -> None:
        try:
            with lock:
                conn.send(message)
        except OSError:                             # the parent is gone; the loop below ends on EOF
            pass
    log.addHandler(_PipeLog(send))
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        engine = ThreadedEngine(start.config, on_failed=lambda: os._exit(70))   # a wedged engine: start anew
    except Exception as e:
        send(m.Started(None, f"{type(e).__name__}: {e}"))
        return
    send(m.Started(engine.config))
    send(m.MetricsSnapshot(engine.metrics.snapshot()))          # the pool's gauges before any request
    metrics, last = engine.metrics, [time.monotonic()]

    def push(d: Delta) -> None:
        now = time.monotonic()
        if d.finished or now - last[0] >= m.METRICS_S:       # a final delta's counters are current when it lands
            last[0] = now
            send(m.MetricsSnapshot(metrics.snapshot()))
        send(d)

    while True:
        try:
            message = conn.recv()
        except EOFError:                            # the parent is gone
            break
        match message:
            case m.Add(request_id=rid, prompt=prompt, params=params):
                try:
                    engine.submit(prompt, params, push, request_id=rid)
                except (ValueError, RuntimeError) as e:
                    send(m.Answer(rid, str(e), type(e).__name__, getattr(e, "retry_after", 0)))
                else:
                    send(m.Answer(rid))
            case m.Abort(request_id=rid):
                engine.abort(rid)
            case m.Stop():
                break
    engine.shutdown()
    send(m.MetricsSnapshot(metrics.snapshot()))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
