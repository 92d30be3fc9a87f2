"""The typed messages between a front end's process and the engine's child process (serving/process.py).

Over one socket pair, pickled (multiprocessing.connection framing):
    parent -> child: Start once, then Add, Abort, and Stop last.
    child -> parent: Started once (the answer to Start, with the config or why it failed); then, in any order,
        Answer (exactly one per Add: the child's validation of it),
        Delta (engine/core/output.py; a request's last one has `finished` set),
        MetricsSnapshot (with each final delta, and at least every METRICS_S while the engine works),
        Log (the child's log records, for the parent to log).
The parent numbers the requests, so a Delta never arrives for an id the parent does not know. When the child
exits, the parent sees EOF and fails every stream still open.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.sampling import SamplingParams

METRICS_S = 0.5


# ---- parent -> child ----

@dataclass(slots=True)
class Start:
    config: EngineConfig


@dataclass(slots=True)
class Add:
    request_id: int
    prompt: str | list[int]
    params: SamplingParams | None


@dataclass(slots=True)
class Abort:
    request_id: int


class Stop:
    """The last message: shut the engine down (requests still running end with an error delta)."""


# ---- child -> parent ----

@dataclass(slots=True)
class Started:
    config: EngineConfig | None     # with the model the child resolved; None when the engine could not start
    error: str = ""


@dataclass(slots=True)
class Answer:
    request_id: int
    error: str = ""                 # empty: added; else why it was refused
    kind: str = ""                  # the refusal's exception class: ValueError is the caller's fault
    retry_after: int = 0            # Overloaded: the seconds a client should wait


@dataclass(slots=True)
class MetricsSnapshot:
    snapshot: Any                   # Metrics.snapshot(), for Metrics.apply


@dataclass(slots=True)
class Log:
    level: int
    text: str
