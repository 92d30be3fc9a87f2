"""Logprobs as MLX arrays, built into the step's graph and read back with its tokens: the log-softmax of the raw
logits (vLLM's default raw_logprobs), as the torch runner's."""
from __future__ import annotations

import mlx.core as mx

from engine.runners.base import PickedLogprobs


def raw(logits: mx.array, rows: list[int]) -> mx.array:
    picked = logits[mx.array(rows)].astype(mx.float32)
    return picked - mx.logsumexp(picked, axis=-1, keepdims=True)


def pick(logprobs: mx.array, tokens: mx.array, rows: list[int], ks: list[int]) -> PickedLogprobs:
    sampled = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=1)
    rank = (logprobs > sampled).sum(axis=1, keepdims=True).astype(mx.int32) + 1
    order = mx.argsort(-logprobs, axis=-1)[:, :max(ks)].astype(mx.int32)
    top = mx.take_along_axis(logprobs, order, axis=1)
    return PickedLogprobs(rows, ks, mx.concatenate([sampled, top], axis=1), mx.concatenate([rank, order], axis=1))
