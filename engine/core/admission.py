"""Admission: whether a request may join the queue now and, when it may not, how long a client should wait before
trying again. Front ends turn Overloaded into HTTP 429 with Retry-After, or Triton's UNAVAILABLE, before they send
any byte, so a router or client can retry the request elsewhere or later."""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 30.0           # how far back the drain rate looks
RETRY_S = (1, 60)         # Retry-After's bounds, seconds


class Overloaded(RuntimeError):
    """The engine cannot queue a request now; `retry_after` is the seconds a client should wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(slots=True)
class Admission:
    max_queue: int
    max_queue_wait: float = 0.0                     # seconds; 0: no bound on the estimated wait
    left: deque[float] = field(default_factory=deque)   # when requests left the queue, over the last WINDOW_S
    lock: threading.Lock = field(default_factory=threading.Lock)     # the step loop and submitters share it

    def leave(self, count: int, now: float) -> None:
        """`count` requests left the queue for the batch at `now`."""
        with self.lock:
            self.left.extend([now] * count)
            self._trim(now)

    def rate(self, now: float) -> float | None:
        """Requests leaving the queue per second, over the window; None before two have left."""
        with self.lock:
            self._trim(now)
            if len(self.left) < 2:
                return None
            return len(self.left) / max(now - self.left[0], 1e-3)

    def _trim(self, now: float) -> None:
        while self.left and now - self.left[0] > WINDOW_S:
            self.left.popleft()

    def wait(self, waiting: int, now: float) -> float | None:
        """The estimated seconds until a request queued now leaves the queue; None while the rate is unknown."""
        rate = self.rate(now)
        return None if rate is None else (waiting + 1) / rate

    def retry_after(self, waiting: int, now: float) -> int:
        """Seconds until the queue ahead has drained, by the measured rate, within RETRY_S."""
        return _seconds(self.wait(waiting, now))

    def check(self, waiting: int, now: float) -> None:
        """Raise Overloaded when a request cannot join a queue of `waiting` now."""
        if waiting >= self.max_queue:
            raise Overloaded(f"queue: {waiting} requests waiting, the limit (max_queue) is reached",
                             self.retry_after(waiting, now))
        wait = self.wait(waiting, now) if self.max_queue_wait else None
        if wait is not None and wait > self.max_queue_wait:
            raise Overloaded(f"queue: the estimated wait ({wait:.1f} s for {waiting} requests ahead) exceeds "
                             f"max_queue_wait ({self.max_queue_wait:g} s)", _seconds(wait))


def _seconds(wait: float | None) -> int:
    low, high = RETRY_S
    return low if wait is None else min(high, max(low, math.ceil(wait)))
