"""EngineProcess: the step loop in a child process, with AsyncEngine's submit / abort / shutdown.

A front end that does Python work for every token (the Triton model builds and sends a response per token) shares
the GIL with an engine thread in its own process: each hand-off of the GIL stalls the engine until the other thread
is scheduled, and on 2 vCPUs that cost the Triton model about a third of its decode speed (README, "Serving path").
In its own process the engine only pickles each delta into a pipe; the front end's threads never hold its GIL.

Messages, child to parent: ("ready", config) | ("failed", message) once; then ("delta", fields), ("refused", id,
kind, message), ("metrics", snapshot), ("log", level, text). Parent to child: ("add", id, prompt, params),
("abort", id), ("stop",). The parent numbers the requests, so a delta can never arrive for an id it does not know.
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
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path

from engine.async_engine import AsyncEngine, Streaming
from engine.config import EngineConfig
from engine.metrics import Metrics
from engine.request import Delta
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer

log = logging.getLogger("pagoda")
METRICS_S = 0.5             # the child sends a metrics snapshot at least this often while it works
DELTA_FIELDS = [f.name for f in fields(Delta)]


def python_executable() -> str:
    """The interpreter the child runs on: inside Triton's Python-backend stub, sys.executable is the stub."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python"):
        return exe
    return shutil.which("python3") or exe


@dataclass(slots=True)
class _Answer:
    """The child's answer to one submit: set once, with the refusal (exception name, message) or None."""
    done: threading.Event = field(default_factory=threading.Event)
    refusal: tuple[str, str] | None = None


class EngineProcess(Streaming):
    def __init__(self, config: EngineConfig) -> None:
        # A plain `python -m` child on a socket pair, not multiprocessing's spawn: that re-imports the parent's
        # __main__, which fails in scripts without a main guard and means nothing inside Triton's stub. Its own
        # session: a Ctrl-C at the terminal reaches the parent, which stops the child in order.
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                             if p)}
        self.proc = subprocess.Popen([python_executable(), "-m", "engine.engine_process", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(config)
        try:
            kind, value = self.conn.recv()
        except EOFError:
            kind, value = "failed", f"exited with code {self.proc.wait()}"
        if kind != "ready":
            raise RuntimeError(f"engine process: {value}")
        self.config: EngineConfig = value           # with the model the child resolved
        self.metrics = Metrics()                    # the child's, as of its last snapshot
        self.streams: dict[int, Callable[[Delta], None]] = {}
        self.waiting: dict[int, _Answer] = {}       # submits awaiting the child's validation
        self.ids = itertools.count()
        self.send_lock = threading.Lock()
        self.running = True
        self.reader = threading.Thread(target=self._read, name="pagoda-engine-link", daemon=True)
        self.reader.start()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """For front ends that template chats; the child tokenizes prompts itself."""
        return Tokenizer(self.config.model)

    def submit(self, prompt: str | list[int], params: SamplingParams | None,
               push: Callable[[Delta], None]) -> int:
        """As AsyncEngine.submit; `push` runs on this process's reader thread. Waits for the child's validation."""
        if not self.running:
            raise RuntimeError("engine: the engine process is not running")
        rid = next(self.ids)
        answer = self.waiting[rid] = _Answer()
        self.streams[rid] = push
        self._send(("add", rid, prompt, params))
        while not answer.done.wait(1.0):
            if not self.reader.is_alive():              # the child died before the reader could answer this one
                answer.refusal = ("RuntimeError", "engine: the engine process exited")
                break
        del self.waiting[rid]
        if answer.refusal is not None:
            self.streams.pop(rid, None)
            kind, message = answer.refusal
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return rid

    def abort(self, request_id: int) -> None:
        if self.running:
            self._send(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child; requests still running end with an error delta."""
        if self.running:
            self._send(("stop",))
        self.reader.join(timeout)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def _send(self, message: tuple) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            pass                                    # the reader sees the child gone and fails its streams

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "delta":
                d = Delta(*message[1])
                push = self.streams.pop(d.request_id, None) if d.finished else self.streams.get(d.request_id)
                if push is not None:
                    push(d)
            elif kind == "metrics":
                self.metrics.apply(message[1])
            elif kind == "log":
                log.log(message[1], "%s", message[2])
            elif kind in ("added", "refused"):
                answer = self.waiting.get(message[1])
                if answer is not None:
                    answer.refusal = message[2:] if kind == "refused" else None
                    answer.done.set()
        self.running = False
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        for answer in list(self.waiting.values()):
            answer.refusal = ("RuntimeError", "engine: the engine process exited")
            answer.done.set()
        for rid, push in list(self.streams.items()):
            del self.streams[rid]
            push(Delta(rid, [], "", True, "error", f"engine: the engine process exited (code {code})"))


class _PipeLog(logging.Handler):
    def __init__(self, send: Callable[[tuple], None]) -> None:
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        self.send(("log", record.levelno, self.format(record)))


def serve(conn: Connection) -> None:
    """The child: an AsyncEngine, on the config the parent sends first, whose deltas, log lines and metrics go up
    the pipe."""
    config: EngineConfig = conn.recv()
    lock = threading.Lock()

    def send(message: tuple) -> None:
        try:
            with lock:
                conn.send(message)
        except OSError:                             # the parent is gone; the loop below ends on EOF
            pass
    log.addHandler(_PipeLog(send))
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        engine = AsyncEngine(config)
    except Exception as e:
        send(("failed", f"{type(e).__name__}: {e}"))
        return
    send(("ready", engine.config))
    metrics, last = engine.engine.metrics, [time.monotonic()]

    def push(d: Delta) -> None:
        now = time.monotonic()
        if d.finished or now - last[0] >= METRICS_S:       # a final delta's counters are current when it lands
            last[0] = now
            send(("metrics", metrics.snapshot()))
        send(("delta", tuple(getattr(d, f) for f in DELTA_FIELDS)))

    while True:
        try:
            message = conn.recv()
        except EOFError:                            # the parent is gone
            break
        kind = message[0]
        if kind == "add":
            _, rid, prompt, params = message
            try:
                engine.submit(prompt, params, push, request_id=rid)
            except (ValueError, RuntimeError) as e:
                send(("refused", rid, type(e).__name__, str(e)))
            else:
                send(("added", rid))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "stop":
            break
    engine.shutdown()
    send(("metrics", metrics.snapshot()))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
