"""What a decode row costs on this machine, for speculation's pricing of its draft rows (engine/core/speculate.py:
Costs). CPUs differ here more than any constant covers: on Gemma 3 270M's int8 blocks with 2 threads, a row past
the 4 cheap ones adds 0.13 of a one-row step on an Intel Xeon with AMX and 0.24 on an AMD EPYC (perf.bench_rows).

Decode steps of 1, `cheap` and 2 x `cheap` rows (at most the pass's rows) run through the model's one-call CPU
layers and its logits, over scratch dense KV, interleaved, and each width's median time gives the costs."""
from __future__ import annotations

import statistics
import time

import torch

from engine.kernels.cpu_layers import Dense

ROUNDS = 4          # the first is a warm-up
CONTEXT = 64        # positions of scratch KV behind each row


class Scratch:
    """An attention the CPU layers take their KV from; they run every layer themselves and never call it."""
    __slots__ = ("dense",)

    def __init__(self, dense: Dense) -> None:
        self.dense = dense


def step_seconds(model, buffers: list[torch.Tensor], rows: int, scale: float) -> float:
    """One decode step of `rows` rows (one token each, at the end of CONTEXT positions): layers, then logits."""
    ids = torch.zeros(rows, dtype=torch.long)
    positions = torch.full((rows,), CONTEXT - 1, dtype=torch.long)
    attn = Scratch(Dense(buffers[:rows], positions + 1, scale))
    start = time.perf_counter()
    model.logits(model(ids, positions, attn))
    return time.perf_counter() - start


@torch.inference_mode()
def row_costs(model, layers: int, kv_shape: tuple[int, ...], dtype: torch.dtype, scale: float, cheap: int,
              most: int) -> tuple[float, float]:
    """(row, late): what a row adds to a one-row step within the first `cheap` rows and past them (`most`: the rows
    a step takes in one pass; where it is `cheap`, no row comes past them and `late` is `row`)."""
    wide = min(2 * cheap, most)
    widths = sorted({1, cheap, wide})
    buffers = [torch.zeros((layers, 2, CONTEXT, *kv_shape), dtype=dtype) for _ in range(wide)]
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(ROUNDS):
        for w in widths:
            times[w].append(step_seconds(model, buffers, w, scale))
    one, at_cheap, at_wide = (statistics.median(times[w][1:]) for w in (1, cheap, wide))
    row = (at_cheap - one) / one / max(cheap - 1, 1)
    late = (at_wide - at_cheap) / one / (wide - cheap) if wide > cheap else row
    return _bounded(row), _bounded(late)


def _bounded(cost: float) -> float:
    """A noisy timing (another process on the cores) must not make rows free or prohibitive."""
    return min(max(cost, 0.02), 1.0)
