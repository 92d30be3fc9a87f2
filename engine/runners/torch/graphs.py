"""Paged decode at fixed shapes, captured as CUDA graphs: one graph per batch-size bucket.

At small batch a GPU decode step is launch-bound (hundreds of kernels, each microseconds of Python and driver
work, against ~0.25 ms of weight reads for a 0.5B bf16 model on an H200). A captured graph replays them all in one
launch. Its inputs are static buffers the step fills in place: token ids, positions, KV slots, lengths and block
tables (each contiguous: the kernels index them as flat arrays). A batch of n runs in the smallest bucket >= n;
the rows past n are padding that writes its K/V into a scratch block the pool never hands out and attends to it
alone. Attention reads a fixed table width, bounded by the served max_model_len, with lengths on the device, so one
graph serves every step of its bucket.

The graph ends in the logits and their argmax (the greedy tokens). Rows that sample otherwise (temperature,
penalties, bias, logprobs, grammar) are sampled after it, eagerly, from the graph's logits.

Off CUDA the same step runs without capture (`cuda_graphs=true` on a CPU): the padding, the buckets and the
buffers are tested there; only the capture waits for a GPU.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.kernels import CALLS, KernelOps
from engine.kv.layout import Layout
from engine.models.decoder import Decoder
from engine.runners.base import Row
from engine.runners.torch.host import upload

log = logging.getLogger("pagoda")


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, then every multiple of 8, up to and including max_batch (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def plain(row: Row) -> bool:
    """Whether the graph's greedy token is this row's sample: nothing changes its logits or reads them."""
    p = row.params
    if row.ban or row.ban_later is not None or row.grammar is not None:
        return False
    return p is None or (p.greedy and not p.penalized and not p.logit_bias and p.logprobs is None
                         and not p.allowed_token_ids)


class GraphDecode:
    def __init__(self, model: Decoder, ops: KernelOps, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 max_batch: int, width: int, scratch: int, capture: bool, windows: list[int] | None = None,
                 layout: Layout | None = None) -> None:
        """`width`: block-table columns (a sequence's most blocks); `scratch`: a block no sequence holds; `layout`:
        the KV layer groups (None: one)."""
        self.model, self.ops, self.k_cache, self.v_cache, self.scale = model, ops, k_cache, v_cache, scale
        self.layout = layout or Layout.of([0] * k_cache.shape[0])
        self.windows = windows or [0] * len(self.layout.group)
        self.sizes = buckets(max_batch)
        self.size, self.width = self.sizes[-1], width
        self.block_size = k_cache.shape[2]
        dev, groups = k_cache.device, self.layout.groups
        self.ids = torch.zeros(self.size, dtype=torch.long, device=dev)
        # positions, lengths, then each group's slots
        self.meta = torch.zeros((2 + groups, self.size), dtype=torch.long, device=dev)
        self.tables = torch.full((groups, self.size, width), scratch, dtype=torch.long, device=dev)
        self.pad = (0, 1, scratch * self.block_size, scratch)          # a padding row: position 0 in the scratch
        self.meta[:] = torch.tensor(self.pad[:2] + (self.pad[2],) * groups, dtype=torch.long, device=dev)[:, None]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.replays = 0              # steps served, captured or not
        if capture:
            self.capture()

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def fill(self, rows: list[Row], ids: torch.Tensor) -> int:
        """Write a step's inputs into the buffers; returns its bucket."""
        n, groups = len(rows), self.layout.groups
        b = self.bucket(n)
        kv = [[r.kv(g) for r in rows] for g in range(groups)]
        used = max(len(t) for per in kv for _, t in per)
        position, length, slot, block = self.pad
        host = [r.start for r in rows] + [position] * (b - n)
        host += [r.start + 1 for r in rows] + [length] * (b - n)
        for per in kv:
            host += [slots[0] for slots, _ in per] + [slot] * (b - n)
        for per in kv:
            for _, table in per:
                host += table + [block] * (used - len(table))
            host += [block] * (used * (b - n))
        flat = upload(host, self.ids.device)                  # one copy to the device a step
        self.ids[:n].copy_(ids)
        rows_meta = (2 + groups) * b
        self.meta[:, :b].copy_(flat[:rows_meta].view(2 + groups, b))
        self.tables[:, :b, :used].copy_(flat[rows_meta:].view(groups, b, used))
        return b

    def run(self, rows: list[Row], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] (fp32) and greedy tokens [n] of a decode step; views of the bucket's outputs, valid until
        the next step."""
        b = self.fill(rows, ids)
        CALLS[self.ops.name] += 1
        self.replays += 1
        if b in self.graphs:
            graph, (logits, tokens) = self.graphs[b]
            graph.replay()
        else:
            logits, tokens = self.step(b)
        return logits[:len(rows)], tokens[:len(rows)]

    def step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step over the buffers' first b rows: embed, every layer (KV write, paged attention), logits,
        argmax. Nothing in it reads the host, so it can be captured."""
        ids, tables = self.ids[:b], self.tables[:, :b]
        positions, lens, slots = self.meta[0, :b], self.meta[1, :b], self.meta[2:, :b]
        ops, kc, vc, scale, bound = self.ops, self.k_cache, self.v_cache, self.scale, self.width * self.block_size
        group, page = self.layout.group, self.layout.slot

        def attend(layer: int, q, k, v):
            g, p = group[layer], page[layer]
            ops.write_kv(kc[p], vc[p], slots[g], k, v)
            return ops.paged_decode_attention(q, kc[p], vc[p], tables[g], lens, scale, bound, self.windows[layer])
        logits = self.model.logits(self.model(ids, positions, attend))
        return logits, logits.argmax(-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (a step's activations are dead by the next,
        so the buckets can share them). Each bucket runs once first, off the graph, to compile its kernels."""
        began = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in self.sizes:
                self.step(b)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.step(b)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        log.info("cuda graphs: captured decode for batch sizes %s in %.1f s", self.sizes, time.perf_counter() - began)
