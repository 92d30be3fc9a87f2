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
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p       # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
