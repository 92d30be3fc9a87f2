"""The lookahead state machine: launch step n+1 from step n's tokens still on the device, then read step n.

States: idle (nothing in flight) -> primed (one step in flight, launched with nothing before it)
-> steady (each tick launches the next step, then reads the previous one). A row that finishes while
a speculative step is in flight is unwound: its speculative KV position is trimmed and its token dropped.
With lookahead off (PAGODA_FORCE_SYNC=1 or lookahead=False) every step is read back right after launch.

Structured output: a step is launched as its model pass, then sampled. A step with a row under a grammar (or
multi-token bad words) is sampled only after the tick's reads were committed (`sample_pending`), so the row's mask
is filled from its latest token while the model pass runs: constrained rows keep the overlap too, and nothing
waits but the host.

A step's rows are grouped by request (`Span`): one row each in a plain step; in a speculative verify step, the
request's next token's row, then one per draft (engine/core/speculate.py). A step launched while a verify step is in
flight chains each request from the row that follows its last draft, assuming every draft is taken; when fewer are,
the request's later positions are trimmed and the step's rows for it are void: read back, they are dropped.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request, Status
from engine.runners.base import ModelRunner, Row, TokenLogprobs


@dataclass(slots=True)
class Span:
    """A request's rows in a step: from row `at` (at position `start`) its next token's row, then a row per draft."""
    req: Request
    at: int
    start: int
    draft: list[int] = field(default_factory=list)
    guess: int = -1           # the token the drafts assume the first row is fed, unknown at launch (-1: known)
    bar: float = 0.0          # verify: the chance of being taken at which the step's last draft row paid

    @property
    def end(self) -> int:
        """The row whose sample is the request's next token when every draft is taken."""
        return self.at + len(self.draft)

    @property
    def live(self) -> bool:
        """Its positions are still the request's: nothing before them was rejected or unwound."""
        return self.req.num_allocated > self.start


Result = tuple[Span, list[int], list[TokenLogprobs | None]]      # a span, its rows' samples, their logprobs


@dataclass(slots=True)
class InFlight:
    handle: Any
    spans: list[Span]
    sampled: bool = False


class Lookahead:
    def __init__(self, runner: ModelRunner, enabled: bool) -> None:
        self.runner = runner
        self.enabled = enabled
        self.inflight: InFlight | None = None
        self.state = "idle"
        self.pipelined = 0      # ticks that launched while the previous step was in flight
        self.unwinds = 0

    def tick(self, batch: list[Request], make_row: Callable[[Request, int], Row]) -> list[Result]:
        """Launch a decode step for `batch`; return the results read back this tick."""
        where = self.sources()
        rows = [make_row(r, where.get(r.id, -1)) for r in batch]
        return self.launch(rows, [Span(r, i, r.num_allocated) for i, r in enumerate(batch)])

    def live(self) -> dict[int, Span]:
        """The step in flight's spans whose positions are still their requests', by request id."""
        return {s.req.id: s for s in self.inflight.spans if s.live} if self.inflight else {}

    def sources(self) -> dict[int, int]:
        """Per request in the step in flight: the row whose sample a step launched now is fed."""
        return {i: s.end for i, s in self.live().items()}

    def launch(self, rows: list[Row], spans: list[Span]) -> list[Result]:
        """Launch `rows` (none: nothing) chained to the step in flight; return the results read back this tick: the
        step in flight's (lookahead off: the new step's)."""
        prev = self.inflight
        launched = None
        if rows:
            launched = InFlight(self.runner.forward(rows, prev.handle if prev else None), spans)
            for s in spans:
                s.req.num_allocated += 1 + len(s.draft)
            if prev:
                self.pipelined += 1
            if not self.enabled or not any(r.deferred for r in rows):
                self._sample(launched)
        if not self.enabled:
            return self._read(launched)
        self.inflight = launched
        self.state = "idle" if launched is None else ("steady" if prev else "primed")
        return self._read(prev)

    def sample_pending(self) -> None:
        """Sample the step in flight if its grammar rows waited for this tick's commits."""
        if self.inflight is not None:
            self._sample(self.inflight)

    def _sample(self, step: InFlight) -> None:
        if not step.sampled:
            self.runner.sample(step.handle)
            step.sampled = True

    def drain(self) -> list[Result]:
        prev, self.inflight, self.state = self.inflight, None, "idle"
        return self._read(prev)

    def reset(self) -> None:
        """Forget the step in flight without reading it (after a failed step)."""
        self.inflight, self.state = None, "idle"

    def unwind(self, req: Request, trim: Callable[[Request, int], None]) -> bool:
        """Drop a finished row's speculative positions so its KV is exactly the synchronous path's."""
        if req.num_allocated == req.num_computed:
            return False
        trim(req, req.num_computed)
        req.num_allocated = req.num_computed
        self.unwinds += 1
        return True

    def _read(self, step: InFlight | None) -> list[Result]:
        if step is None:
            return []
        self._sample(step)
        sampled = self.runner.fetch(step.handle)
        logprobs = sampled.logprobs or [None] * len(sampled.tokens)
        out = []
        for s in step.spans:         # a request unwound, or whose earlier drafts were not all taken: dropped
            if s.req.status is Status.RUNNING and s.live and s.req.num_computed == s.start:
                out.append((s, sampled.tokens[s.at:s.end + 1], logprobs[s.at:s.end + 1]))
        return out
