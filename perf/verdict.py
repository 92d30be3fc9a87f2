"""Hit vs miss, settled: a paired ratio with its 95% interval, and the one-line verdict the main job ends with.

Each pair is a MISS and a HIT run back to back (the bench's groups, or neighbouring perf_analyzer requests), so
drift on a shared machine falls on both; the ratio is the median of the per-pair hit/miss ratios, its interval
the percentile bootstrap of that median. The verdict reads the interval against a tolerance: inside it, hit and
miss decode are equal within the interval's width; wholly outside it, one is slower; otherwise, unsettled.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from perf.common import bootstrap_interval

TOLERANCE = 0.03        # the product's promise: hit decode within 3% of miss decode


@dataclass(slots=True, frozen=True)
class Ratio:
    value: float        # median of the per-pair ratios
    lo: float           # its 95% interval
    hi: float
    n: int              # pairs

    @property
    def half_width(self) -> float:
        """The interval's farthest reach from 1.0, as a fraction."""
        return max(abs(1 - self.lo), abs(self.hi - 1))

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
    """(miss, hit) measurements of one quantity per pair -> the median hit/miss ratio and its interval. Pairs with
    a missing side (NaN) are left out."""
    ratios = [h / m for m, h in pairs if m > 0 and not math.isnan(m) and not math.isnan(h)]
    if not ratios:
        return Ratio(float("nan"), float("nan"), float("nan"), 0)
    lo, hi = bootstrap_interval(ratios)
    return Ratio(statistics.median(ratios), lo, hi, len(ratios))


def call(r: Ratio, tolerance: float = TOLERANCE) -> str:
    """equal | slower | faster | unsettled: what a decode-rate ratio's interval supports."""
    if r.n < 2 or math.isnan(r.lo):
        return "unsettled"
    if r.hi < 1 - tolerance:
        return "slower"
    if r.lo > 1 + tolerance:
        return "faster"
    if 1 - tolerance <= r.lo and r.hi <= 1 + tolerance:
        return "equal"
    return "unsettled"


def sentence(r: Ratio, tolerance: float = TOLERANCE) -> str:
    """The verdict on one decode-rate ratio, in words, with its interval and pair count."""
    ci = f"95% CI {r.lo:.3f}-{r.hi:.3f}, {r.n} pairs"
    match call(r, tolerance):
        case "equal":
            side = "" if r.lo <= 1 <= r.hi else (", hit slower" if r.hi < 1 else ", hit faster")
            return f"hit decode = miss decode within ±{100 * r.half_width:.1f}% ({ci}{side})"
        case "slower":
            return f"hit decode is slower: {r.value:.3f} ({ci})"
        case "faster":
            return f"hit decode is faster: {r.value:.3f} ({ci})"
    if r.n < 2:
        return f"unsettled: {r.value:.3f} from {r.n} pair"
    return f"unsettled: {r.value:.3f} ({ci}) reaches past ±{100 * tolerance:.0f}%: more pairs needed"


def verdict(storage: str, engine: Ratio, client: Ratio, tolerance: float = TOLERANCE) -> str:
    """One line per storage: the engine's own timing decides (it is free of the transport); the client's, what a
    user sees through the serving stack, follows."""
    return (f"{storage}: at the engine, {sentence(engine, tolerance)}; "
            f"at the client, {sentence(client, 2 * tolerance)}")
