"""Hit vs miss, settled: a paired ratio with its 95% interval, and the one-line verdict the main job ends with.

Each pair is a MISS and a HIT run back to back (the bench's groups, or neighbouring perf_analyzer requests), so
drift on a shared machine falls on both. The ratio is the 20%-trimmed mean of the per-pair log ratios, exponentiated:
a stray pair (a burst of load from another tenant of the host) moves it no more than it moves a median, and it is
tighter than the median of the same pairs. Its interval is the percentile bootstrap of that estimate. The verdict
reads the interval against a tolerance (see `call`): as narrow as the tolerance and holding 1.0, hit and miss decode
are equal within the interval's reach; wholly beyond it, one is slower; otherwise, unsettled.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from perf.common import bootstrap_interval

TOLERANCE = 0.03        # the product's promise: hit decode within 3% of miss decode
TRIM = 0.2              # of the per-pair log ratios, cut from each end


def center(logs: Sequence[float]) -> float:
    """The trimmed mean of log ratios."""
    s = sorted(logs)
    k = int(len(s) * TRIM)
    return statistics.fmean(s[k:len(s) - k])


@dataclass(slots=True, frozen=True)
class Ratio:
    value: float        # exp of the trimmed mean of the per-pair log ratios
    lo: float           # its 95% interval
    hi: float
    n: int              # pairs

    @property
    def reach(self) -> float:
        """The interval's farthest reach from 1.0, as a fraction."""
        return max(abs(1 - self.lo), abs(self.hi - 1))

    @property
    def half_width(self) -> float:
        """Half the interval's width, relative to the ratio: how settled it is, wherever it lies."""
        return (self.hi - self.lo) / (2 * self.value) if self.n >= 2 else float("inf")

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.value:.3f} (1 pair: no interval)"
        return f"{self.value:.3f} ({self.lo:.3f}-{self.hi:.3f})"

    def as_dict(self) -> dict:
        return {"value": self.value, "ci95": [self.lo, self.hi], "pairs": self.n}

    @classmethod
    def of(cls, d: dict) -> Ratio:
        """The inverse of as_dict (a ratio read back from a report)."""
        return cls(d["value"], *d["ci95"], d["pairs"])


def ratio(pairs: Sequence[tuple[float, float]]) -> Ratio:
    """(miss, hit) measurements of one quantity per pair -> the hit/miss ratio and its interval. Pairs with a
    missing side (NaN, or not positive) are left out."""
    logs = [math.log(h / m) for m, h in pairs if m > 0 and h > 0]     # NaN compares False: left out too
    if not logs:
        return Ratio(float("nan"), float("nan"), float("nan"), 0)
    lo, hi = bootstrap_interval(logs, stat=center)          # NaN for a single pair
    return Ratio(math.exp(center(logs)), math.exp(lo), math.exp(hi), len(logs))


def call(r: Ratio, tolerance: float = TOLERANCE) -> str:
    """equal | slower | faster | unsettled: what a decode-rate ratio's interval supports. Equal: the interval is at
    most +-tolerance wide and holds 1.0 (or lies within 1 +- tolerance). Slower or faster: it lies wholly beyond the
    tolerance, so noise alone almost never calls a difference. Anything else: unsettled, more pairs needed."""
    if r.n < 2 or math.isnan(r.lo):
        return "unsettled"
    if r.hi < 1 - tolerance:
        return "slower"
    if r.lo > 1 + tolerance:
        return "faster"
    if r.half_width <= tolerance and (r.lo <= 1 <= r.hi or r.reach <= tolerance):
        return "equal"
    return "unsettled"


def sentence(r: Ratio, tolerance: float = TOLERANCE) -> str:
    """The verdict on one decode-rate ratio, in words, with its interval and pair count."""
    ci = f"95% CI {r.lo:.3f}-{r.hi:.3f}, {r.n} pairs"
    match call(r, tolerance):
        case "equal":
            side = "" if r.lo <= 1 <= r.hi else (", hit slower" if r.hi < 1 else ", hit faster")
            return f"hit decode = miss decode within ±{100 * r.reach:.1f}% ({ci}{side})"
        case "slower":
            return f"hit decode is slower: {r.value:.3f} ({ci})"
        case "faster":
            return f"hit decode is faster: {r.value:.3f} ({ci})"
    if r.n < 2:
        return f"unsettled: {r.value:.3f} from {r.n} pair"
    return f"unsettled: {r.value:.3f} ({ci}) is wider than ±{100 * tolerance:.0f}% or misses 1.0: more pairs needed"


def verdict(storage: str, engine: Ratio, client: Ratio, tolerance: float = TOLERANCE) -> str:
    """One line per storage: the engine's own timing decides (it is free of the transport); the client's, what a
    user sees through the serving stack, follows."""
    return (f"{storage}: at the engine, {sentence(engine, tolerance)}; "
            f"at the client, {sentence(client, 2 * tolerance)}")
