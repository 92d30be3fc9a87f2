"""MLX runner: steps are built lazily on a dedicated stream and started with mx.async_eval, so step n+1 can be
launched from step n's sampled tokens before they are read back."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.core.sampling import SamplingParams
from engine.kv.layout import Layout
from engine.models.decoder_mlx import load_mlx
from engine.runners.base import Geometry, PickedLogprobs, Row, Sampled, flatten, in_order, logprob_rows
from engine.runners.mlx import attention as mlx_attention
from engine.runners.mlx import logprobs


@dataclass(slots=True)
class Step:
    tokens: mx.array      # [rows] int32, -1 where a row did not sample
    logprobs: PickedLogprobs | None = None     # of the rows that asked


class MLXRunner:
    def __init__(self, model_dir: str | Path, dtype: str = "auto", seed: int = 0) -> None:
        mx.random.seed(seed)          # what sampled requests without a seed of their own draw from
        self.model = load_mlx(model_dir, dtype)
        cfg = self.model.cfg
        self.dtype = self.model.dtype
        g = Geometry.of(cfg, self.dtype.size)
        self.vocab_size, self.max_model_len, self.eos_token_ids = g.vocab_size, g.max_model_len, g.eos_token_ids
        self.layers, self.kv_shape, self.bytes_per_token, self.scale = g.layers, g.kv_shape, g.bytes_per_token, g.scale
        self.windows = g.windows
        self.streams: dict[int, mx.Stream] = {}      # MLX streams belong to the thread that made them
        self.paged = False                # init_paged: a block pool; else one dense buffer per sequence
        self.k_cache: list[mx.array] = []
        self.v_cache: list[mx.array] = []
        self.block_size = 0
        self.layout: Layout | None = None     # paged: the layer groups (engine/kv/layout.py)
        self.dense: dict[int, list[list[mx.array]]] = {}
        self.next_buf = 0
        self.keys: dict[int, mx.array] = {}
        self.tokens_computed = 0
        self.step_rows = self.cheap_rows = 16
        self.overlaps = True              # mx.async_eval: a step runs while the next is built

    def kv_budget(self, utilization: float, prefill_tokens: int) -> int | None:
        return None                   # unified memory: kv_cache_bytes bounds the pool

    def init_paged(self, num_blocks: int, block_size: int, layout: Layout | None = None) -> None:
        self.paged = True
        self.block_size = block_size
        self.layout = layout = layout or Layout.of(self.windows, hybrid=False)
        shape = (num_blocks * block_size, *self.kv_shape)
        self.k_cache = [mx.zeros(shape, dtype=self.dtype) for _ in range(layout.width)]
        self.v_cache = [mx.zeros(shape, dtype=self.dtype) for _ in range(layout.width)]
        mx.eval(self.k_cache, self.v_cache)

    def _buffer(self, capacity: int) -> list[list[mx.array]]:
        with mx.stream(self._stream()):
            return [[mx.zeros((capacity, *self.kv_shape), dtype=self.dtype) for _ in range(2)]
                    for _ in range(self.layers)]

    def dense_alloc(self, capacity: int) -> int:
        buf, self.next_buf = self.next_buf, self.next_buf + 1
        self.dense[buf] = self._buffer(capacity)
        return buf

    def dense_resize(self, buf: int, capacity: int) -> None:
        old, new = self.dense[buf], self._buffer(capacity)
        n = min(capacity, old[0][0].shape[0])
        with mx.stream(self._stream()):
            for layer in range(self.layers):
                for i in range(2):
                    new[layer][i][:n] = old[layer][i][:n]
        self.dense[buf] = new

    def dense_free(self, buf: int) -> None:
        del self.dense[buf]

    def dense_copy(self, src: int, dst: int, positions: int) -> None:
        with mx.stream(self._stream()):
            for layer in range(self.layers):
                for i in range(2):
                    self.dense[dst][layer][i][:positions] = self.dense[src][layer][i][:positions]

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        with mx.stream(self._stream()):
            for cache in (self.k_cache, self.v_cache):
                for page in cache:
                    page[dst * bs:(dst + 1) * bs] = page[src * bs:(src + 1) * bs]

    def row_costs(self) -> None:
        return None

    def check(self, params: SamplingParams) -> None:
        for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("min_p", 0), ("logit_bias", None)):
            if getattr(params, name) not in (off, {}):
                raise ValueError(f"{name}: not supported by the MLX runner yet")
        for name in ("bad_words", "allowed_token_ids", "prompt_logprobs"):
            if getattr(params, name):
                raise ValueError(f"{name}: not supported by the MLX runner yet")
        if params.structured_outputs is not None:
            field = params.structured_outputs.field.split(".")[0]
            raise ValueError(f"{field}: not supported by the MLX runner yet")

    def release(self, seq: int) -> None:
        self.keys.pop(seq, None)

    def _sample(self, logits: mx.array, rows: list[Row]) -> tuple[mx.array, PickedLogprobs | None]:
        asked = logprob_rows(rows)
        raw = logprobs.raw(logits, asked) if asked else None         # before the bans below
        for i, row in enumerate(rows):
            if row.ban:
                logits[i, mx.array(row.ban)] = -mx.inf
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        for i, row in enumerate(rows):
            if row.params is not None and not row.params.greedy:
                tokens[i] = self._sample_one(logits[i], row.params, row.seq)
        if raw is None:
            return tokens, None
        return tokens, logprobs.pick(raw, tokens[mx.array(asked)], asked, [rows[i].params.logprobs for i in asked])

    def _sample_one(self, logits: mx.array, p: SamplingParams, seq: int) -> mx.array:
        key = self.keys.get(seq)
        if key is None:
            key = mx.random.key(p.seed if p.seed is not None else int(mx.random.randint(0, 2**31, ()).item()))
        key, sub = mx.random.split(key)
        self.keys[seq] = key
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = mx.partition(logits, -p.top_k)[-p.top_k]         # the k-th largest, without a sort
            logits = mx.where(logits < kth, -mx.inf, logits)
        if p.top_p < 1.0:
            order = mx.argsort(-logits)
            probs = mx.softmax(logits[order])
            drop = (mx.cumsum(probs) - probs) > p.top_p
            mask = mx.zeros(logits.shape, dtype=mx.bool_)
            mask[order] = drop
            logits = mx.where(mask, -mx.inf, logits)
        return mx.random.categorical(logits, key=sub).astype(mx.int32)

    def _stream(self) -> mx.Stream:
        tid = threading.get_ident()
        if tid not in self.streams:
            self.streams[tid] = mx.new_stream(mx.default_device())
        return self.streams[tid]

    def forward(self, rows: list[Row], prev: Step | None) -> Step:
        with mx.stream(self._stream()):
            ids, positions, chained, last = flatten(rows)
            if in_order(chained, len(ids)):
                ids_a = prev.tokens[:len(ids)]
            else:
                ids_a = mx.array(ids, dtype=mx.int32)
                if chained:
                    dst, src = zip(*chained)
                    ids_a[mx.array(dst)] = prev.tokens[mx.array(src)]
            if self.paged:
                attn = mlx_attention.paged(self.k_cache, self.v_cache, self.block_size, rows, self.scale,
                                           self.windows, self.layout)
            else:
                attn = mlx_attention.dense(self.dense, rows, self.scale, self.windows)
            hidden = self.model.forward(ids_a, mx.array(positions), attn)
            self.tokens_computed += len(ids)
            picked = [i for i, r in enumerate(rows) if r.sample]
            found = None
            if len(picked) == len(rows):            # every decode step: no scatter into a -1 filled array
                last_hidden = hidden if len(ids) == len(rows) else hidden[mx.array(last)]
                tokens, found = self._sample(self.model.logits(last_hidden), rows)
            else:
                tokens = mx.full((len(rows),), -1, dtype=mx.int32)
                if picked:
                    logits = self.model.logits(hidden[mx.array([last[i] for i in picked])])
                    tokens[mx.array(picked)], found = self._sample(logits, [rows[i] for i in picked])
                    found = found and found.remap(picked)
            if prev is not None:
                # The graph above is built while the previous step runs. Dispatch waits for it: until its work
                # is done it still holds the cache buffers, and the scatters would copy each whole cache instead
                # of writing in place. Its tokens stay on the device.
                mx.eval(prev.tokens)
            extra = (found.values, found.ids) if found else ()
            mx.async_eval(tokens, *extra, *self.k_cache, *self.v_cache)
        return Step(tokens, found)

    def sample(self, step: Step) -> None:
        pass            # sampling is part of the lazy graph `forward` started (no grammar masks to wait for)

    def fetch(self, step: Step) -> Sampled:
        tokens = step.tokens.tolist()
        return Sampled(tokens, step.logprobs and step.logprobs.read(len(tokens)))
