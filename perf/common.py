"""What every benchmark measures the same way: prompts, the decode rate, paired ratios, tables and plots.

Decode rate of one request = (tokens - 1) / (t_last_token - t_first_token), from token arrival times. Two
measurements are compared by the median of per-pair ratios, pairs interleaved, so drift on a shared machine
between pairs cancels.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from engine.core.engine import Engine
from engine.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(n: int = 32, seed: int = 0, low: int = 3, high: int = 800) -> list[int]:
    """A prompt of `n` random token ids from the trained tokenizer's range (the special tokens are below 3)."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


def decode_rate(times: Sequence[float]) -> float:
    """(tokens - 1) / (t_last - t_first) over token arrival times; NaN with fewer than two distinct times."""
    if len(times) < 2 or times[-1] <= times[0]:
        return float("nan")
    return (len(times) - 1) / (times[-1] - times[0])


def greedy_run(engine: Engine, prompt: str | list[int], max_tokens: int, lookahead: bool | None = None,
               **params) -> tuple[float, float]:
    """One request (EOS ignored; greedy unless `params` say otherwise) through the engine in process: (TTFT in
    seconds, decode tok/s).
    `lookahead` switches the engine's lookahead for this request (False: the PAGODA_FORCE_SYNC path); `params`
    are more SamplingParams (logprobs=5)."""
    if lookahead is not None:
        engine.lookahead.enabled = lookahead
    times: list[float] = []
    engine.on_delta = lambda d: times.extend([time.perf_counter()] * len(d.token_ids))
    start = time.perf_counter()
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0, **params})
    engine.add(engine.make_request(prompt, sampling))
    while engine.has_work:
        engine.step()
    return times[0] - start, decode_rate(times)


class Pair(NamedTuple):
    pagoda: float       # median
    peer: float         # median
    ratio: float        # median of the per-pair ratios: drift between pairs cancels
    low: float = float("nan")     # the least and the greatest per-pair ratio
    high: float = float("nan")


def ratio_of_pairs(xs: Sequence[float], ys: Sequence[float]) -> float:
    return statistics.median(x / y for x, y in zip(xs, ys))


def paired(xs: Sequence[float], ys: Sequence[float]) -> Pair:
    ratios = [x / y for x, y in zip(xs, ys)]
    return Pair(statistics.median(xs), statistics.median(ys), statistics.median(ratios), min(ratios), max(ratios))


def median_pair(a: Callable[[], float], b: Callable[[], float], repeats: int) -> Pair:
    """Interleave two measurements `repeats` times, in ABBA order so that neither always runs first."""
    xs, ys = [], []
    for i in range(repeats):
        for f in ((a, b) if i % 2 == 0 else (b, a)):
            (xs if f is a else ys).append(f())
    return paired(xs, ys)


def spread(values: Sequence[float]) -> list[float]:
    """[median, min, max]."""
    return [statistics.median(values), min(values), max(values)]


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0,
                       stat: Callable[[Sequence[float]], float] = statistics.median) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat` (the median unless named): how far a paired ratio could move on a
    rerun."""
    if len(values) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    estimates = sorted(stat(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return estimates[int(tail * resamples)], estimates[min(resamples - 1, int((1 - tail) * resamples))]


def table(header: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """A text table: the first `left` columns left-aligned, the rest right-aligned, each as wide as it needs."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join(" ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in cells)


def range_cell(values: Sequence[float], digits: int = 1) -> str:
    """'median (min-max)' of [median, min, max]."""
    med, lo, hi = values
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def plot_requests(series: dict[str, list[tuple[float, float, float]]], path: str | Path, title: str) -> None:
    """Two panels, decode tok/s and TTFT (ms, log scale) per request: series label -> [(x, tok/s, ttft ms)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, points) in enumerate(series.items()):
        marker = "o^sv"[i % 4]
        axes[0].plot([p[0] for p in points], [p[1] for p in points], marker, label=label)
        axes[1].plot([p[0] for p in points], [p[2] for p in points], marker, label=label)
    axes[0].set(title=f"{title}: decode tok/s per request", xlabel="request", ylabel="tok/s")
    axes[1].set(title=f"{title}: TTFT per request", xlabel="request", ylabel="ms", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), so figures from different machines are never read as one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
