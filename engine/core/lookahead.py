"""The lookahead state machine: launch step n+1 from step n's tokens still on the device, then read step n.

States: idle (nothing in flight) -> primed (one step in flight, launched with nothing before it)
-> steady (each tick launches the next step, then reads the previous one). A row that finishes while
a speculative step is in flight is unwound: its speculative KV position is trimmed and its token dropped.
With lookahead off (PAGODA_FORCE_SYNC=1 or lookahead=False) every step is read back right after launch.

Structured output: a step is launched as its model pass, then sampled. A step with a row under a grammar (or
multi-token bad words) is sampled only after the tick's reads were committed (`sample_pending`), so the row's mask
is filled from its latest token while the model pass runs: constrained rows keep the overlap too, and nothing
waits but the host.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.request import Request, Status
from engine.runners.base import ModelRunner, Row, TokenLogprobs

Result = tuple[Request, int, TokenLogprobs | None]       # a request, its sampled token, the token's logprobs


@dataclass(slots=True)
class InFlight:
    handle: Any
    reqs: list[Request]
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
        prev = self.inflight
        launched = None
        if batch:
            where = {r.id: i for i, r in enumerate(prev.reqs)} if prev else {}
            rows = [make_row(r, where.get(r.id, -1)) for r in batch]
            launched = InFlight(self.runner.forward(rows, prev.handle if prev else None), batch)
            for r in batch:
                r.num_allocated += 1
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
        for req, token, lp in zip(step.reqs, sampled.tokens, logprobs):
            if req.status is Status.RUNNING and req.num_allocated > req.num_computed:
                req.num_computed += 1
                out.append((req, token, lp))
        return out
