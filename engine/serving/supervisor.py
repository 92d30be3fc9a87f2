"""When the engine's child process dies: how long to wait before starting the next one, and when to stop trying.

Plain logic over timestamps; ProcessEngine acts on it. A death within `window` seconds of `limit` others is a crash
loop: no more restarts, the engine is down for good and the front end reports not ready, so an orchestrator
replaces the replica instead of sending it traffic that can only fail.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class Health(Enum):
    UP = "up"                   # serving
    RESTARTING = "restarting"   # the engine died; a new one is being started: requests are refused, retry soon
    FAILED = "failed"           # a crash loop or a wedged engine: down for good
    STOPPED = "stopped"         # shut down on purpose: down for good, nothing to replace (an unload asked for
                                # while Triton finalizes the model aborts tritonserver)


@dataclass(slots=True)
class Restarts:
    limit: int = 5              # deaths within `window` that end the restarts
    window: float = 60.0        # seconds
    base: float = 0.25          # the first wait; each death inside the window doubles it, up to `cap`
    cap: float = 8.0
    deaths: deque[float] = field(default_factory=deque)

    def died(self, now: float) -> float | None:
        """Record a death at `now`: the seconds to wait before restarting, or None to stop."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.window:
            self.deaths.popleft()
        if len(self.deaths) >= self.limit:
            return None
        return min(self.cap, self.base * 2 ** (len(self.deaths) - 1))


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (restarting) or any more (failed): Triton's UNAVAILABLE, HTTP 503."""
