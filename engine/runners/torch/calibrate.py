"""What a decode row costs on this machine, for speculation's pricing of its draft rows (engine/core/speculate.py:
Costs). CPUs differ here more than any constant covers: on Gemma 3 270M's int8 blocks with 2 threads, a row past
the 4 cheap ones added 0.13 of a one-row step on an Intel Xeon with AMX and 0.24 on an AMD EPYC (perf.bench_rows),
and 0.2 on that Xeon once the GEMVs prefetched their streams ahead there (a faster one-row step).

Decode steps of 1, `cheap`, `cheap` + 1 and 2 x `cheap` rows (at most the pass's rows) run through the model's
one-call CPU layers, its logits and greedy sampling, over scratch dense KV, in pairs of rounds that cancel the
machine's drift (row_costs); a row drawn at temperature 1 instead adds what its draw takes (a 262k-token
vocabulary's softmax and draw cost a sampled row about 0.08 of a one-row step on that Xeon)."""
from __future__ import annotations

import statistics
import time

import torch

from engine.core.sampling import SamplingParams
from engine.kernels.cpu_layers import Dense
from engine.runners.torch.sampler import argmax, sample_one

PAIRS = 6           # of rounds, after a warm-up
CONTEXT = 64        # positions of scratch KV behind each row


class Scratch:
    """An attention the CPU layers take their KV from; they run every layer themselves and never call it."""
    __slots__ = ("dense",)

    def __init__(self, dense: Dense) -> None:
        self.dense = dense


def step_seconds(model, buffers: list[torch.Tensor], rows: int, scale: float) -> tuple[float, float]:
    """One decode step of `rows` rows (one token each, at the end of CONTEXT positions): the seconds its layers,
    logits and argmax took, and then the seconds one row's draw at temperature 1 takes."""
    ids = torch.zeros(rows, dtype=torch.long)
    positions = torch.full((rows,), CONTEXT - 1, dtype=torch.long)
    attn = Scratch(Dense(buffers[:rows], positions + 1, scale))
    start = time.perf_counter()
    logits = model.logits(model(ids, positions, attn))
    argmax(logits)
    mid = time.perf_counter()
    sample_one(logits[0], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    return mid - start, time.perf_counter() - mid


@torch.inference_mode()
def row_costs(model, layers: int, kv_shape: tuple[int, ...], dtype: torch.dtype, scale: float, cheap: int,
              most: int) -> tuple[float, float, float]:
    """(row, late, sampled): what a row adds to a one-row step within the first `cheap` rows and past them (`most`:
    the rows a step takes in one pass; where it is `cheap`, no row comes past them and `late` is `row`; else the
    first row past them, where it costs more than their mean up to 2 x `cheap`), and what a row drawn at a
    temperature adds to that. After a warm-up, each of PAIRS pairs of rounds times every width forwards, then
    backwards, and prices rows by the pair's sums, so that a drift of the machine's speed (it moves within seconds on
    these VMs) cancels within a pair; the costs are the medians of the pairs' prices."""
    wide, first = min(2 * cheap, most), min(cheap + 1, most)
    widths = sorted({1, cheap, first, wide})
    buffers = [torch.zeros((layers, 2, CONTEXT, *kv_shape), dtype=dtype) for _ in range(wide)]
    for w in widths:
        step_seconds(model, buffers, w, scale)                  # a warm-up
    rows, lates, draws = [], [], []
    for _ in range(PAIRS):
        step, draw = dict.fromkeys(widths, 0.0), 0.0
        for w in widths + widths[::-1]:
            seconds, drawn = step_seconds(model, buffers, w, scale)
            step[w] += seconds
            draw += drawn if w == 1 else 0.0
        one = step[1]
        rows.append((step[cheap] - one) / one / max(cheap - 1, 1))
        # the dearer of the first row past the cheap ones and their mean: where a step's pass changes shape there
        # (the VNNI GEMV's 512-bit pairs from 5 rows on a Zen 4) the first costs more than the rest
        lates.append(max(step[first] - step[cheap], (step[wide] - step[cheap]) / (wide - cheap)) / one
                     if wide > cheap else rows[-1])
        draws.append(draw / one)
    return (_bounded(statistics.median(rows)), _bounded(statistics.median(lates)),
            _bounded(statistics.median(draws), 0.0))


def _bounded(cost: float, low: float = 0.02) -> float:
    """A noisy timing (another process on the cores) must not make rows free or prohibitive."""
    return min(max(cost, low), 1.0)
