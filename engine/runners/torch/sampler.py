"""Sampling on the device: greedy, temperature, top-k, top-p, per-request seeded generators."""
from __future__ import annotations

import functools

import torch

from engine.core.sampling import SamplingParams
from engine.kernels import cpu_pointwise
from engine.runners.base import Row


def sample(logits: torch.Tensor, rows: list[Row], generator_for) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] (int64), sampled without leaving the device."""
    for i, row in enumerate(rows):
        ban = [*row.ban, *row.ban_later()] if row.ban_later else row.ban
        if ban:
            logits[i, list(ban)] = float("-inf")
        if row.params is not None and row.params.allowed_token_ids:
            keep = torch.tensor(row.params.allowed_token_ids, device=logits.device)
            logits[i] = torch.full_like(logits[i], float("-inf")).index_copy_(0, keep, logits[i, keep])
    tokens = argmax(logits)
    for i, row in enumerate(rows):
        if row.params is not None and not row.params.greedy:
            tokens[i] = sample_one(logits[i], row.params, generator_for(row))
    return tokens


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1); on a CPU through the kernels' vectorised pass where they are built."""
    ops = _pointwise() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if ops is None or logits.dim() != 2 or not logits.is_contiguous():
        return logits.argmax(-1)
    return ops.argmax(logits)


_pointwise = functools.cache(cpu_pointwise.load)


def sample_one(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[-1]:
        top, ids = torch.topk(logits, p.top_k)
        # on a CPU, unless others tie with the k-th, the k tokens alone, their softmax already in falling order
        if logits.device.type == "cpu" and int((logits >= top[-1]).sum()) == p.top_k:
            probs = top.softmax(-1)
            if p.top_p < 1.0:
                probs = probs.masked_fill(~within(probs, p.top_p), 0)
            return pick(ids, draw(probs, generator))
        logits = logits.masked_fill(logits < top[-1], float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        probs, ids = nucleus(probs, p.top_p)
        return pick(ids, draw(probs, generator))
    return draw(probs, generator)


def pick(ids: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """ids[i] for a 0-d i, without reading i on the host (indexing by a 0-d tensor would)."""
    return ids.gather(0, i.view(1))[0]


def within(falling: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of these probabilities (in falling order) top_p keeps: each while the mass before it is at most top_p."""
    return falling.cumsum(-1) - falling <= top_p


NUCLEUS_FIRST = (64, 1024)     # how many of the most likely tokens a CPU looks for top_p's cut among, in turn


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, ids) in falling order, those top_p drops at probability 0. Sorting a 262k vocabulary takes a
    CPU tens of milliseconds: there the most likely 64, then 1024 (topk, sorted) decide alone when they hold more
    than top_p, as they usually do. (A GPU sorts them all, which costs it little and asks the host nothing.)"""
    for k in NUCLEUS_FIRST if probs.device.type == "cpu" else ():
        top, order = torch.topk(probs, min(k, probs.shape[-1]))
        if top.cumsum(-1)[-1] > top_p:
            break
    else:
        top, order = torch.sort(probs, descending=True)
    return top.masked_fill(~within(top, top_p), 0), order


DRAW_BLOCK = 512     # a CPU's draw finds the block of this many tokens first, then the token in it


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A token drawn from `probs` (unnormalised): the first whose cumulative mass (fp64) passes a uniform draw below
    the total, so never one of probability 0: torch.multinomial's distribution, without the milliseconds it spends a
    draw over a 262k vocabulary on a CPU. A CPU scans block sums, then the one block the draw falls in (one fp64
    cumsum over 262k tokens takes it over a millisecond); a GPU takes the cumsum whole, asking the host nothing."""
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)
    n, b = probs.shape[-1], DRAW_BLOCK
    if probs.device.type != "cpu":
        cdf = probs.cumsum(-1, dtype=torch.float64)
        return _first_past(cdf, u * cdf[-1:]).clamp_(max=n - 1)      # (a row of NaNs: in range, not a crash)
    whole = n // b * b
    sums = probs[:whole].reshape(-1, b).sum(-1, dtype=torch.float64)
    if whole < n:
        sums = torch.cat([sums, probs[whole:].sum(-1, dtype=torch.float64).view(1)])
    cdf = sums.cumsum(-1)
    if not float(cdf[-1]) > 0:
        raise ValueError("sampling: every token is masked (bad words, allowed_token_ids, logit_bias or the grammar)")
    target = u * cdf[-1:]
    j = int(_first_past(cdf, target))
    inner = probs[j * b:(j + 1) * b].cumsum(-1, dtype=torch.float64)
    return j * b + _first_past(inner, (target - (cdf[j] - sums[j])).clamp_(min=0))


def _first_past(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass is above `target`, held below the total (a token of mass 0 never is)."""
    return torch.searchsorted(cdf, torch.minimum(target, torch.nextafter(cdf[-1:], torch.zeros_like(cdf[-1:]))),
                              right=True)[0]
