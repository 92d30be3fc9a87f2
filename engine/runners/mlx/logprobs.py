"""Logprobs as MLX arrays, built into the step's graph and read back with its tokens: the log-softmax of the raw
logits (vLLM's default raw_logprobs), as the torch runner's."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.runners.base import Row, TokenLogprobs, read_logprobs


@dataclass(slots=True)
class ArrayLogprobs:
    rows: list[int]                   # the step's rows that asked, in order
    ks: list[int]                     # how many top tokens each asked for
    values: mx.array                  # [n, 1 + k] fp32: the sampled token's logprob, then the top k
    ids: mx.array                     # [n, 1 + k] int32: the sampled token's rank, then the top k ids

    def remap(self, rows: list[int]) -> ArrayLogprobs:
        return ArrayLogprobs([rows[i] for i in self.rows], self.ks, self.values, self.ids)

    def read(self, n_rows: int) -> list[TokenLogprobs | None]:
        return read_logprobs(n_rows, self.rows, self.ks, self.values.tolist(), self.ids.tolist())


def wanted(rows: list[Row]) -> list[int]:
    return [i for i, r in enumerate(rows) if r.params is not None and r.params.logprobs is not None]


def raw(logits: mx.array, rows: list[int]) -> mx.array:
    picked = logits[mx.array(rows)].astype(mx.float32)
    return picked - mx.logsumexp(picked, axis=-1, keepdims=True)


def pick(logprobs: mx.array, tokens: mx.array, rows: list[int], ks: list[int]) -> ArrayLogprobs:
    sampled = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=1)
    rank = (logprobs > sampled).sum(axis=1, keepdims=True).astype(mx.int32) + 1
    order = mx.argsort(-logprobs, axis=-1)[:, :max(ks)].astype(mx.int32)
    top = mx.take_along_axis(logprobs, order, axis=1)
    return ArrayLogprobs(rows, ks, mx.concatenate([sampled, top], axis=1), mx.concatenate([rank, order], axis=1))
