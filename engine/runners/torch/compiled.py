"""The paged decode step as one torch.compile'd graph: embed, every layer, KV write, attention and logits.

Eager decode of a small model is bound by per-op dispatch (hundreds of aten calls a step); compiled, the step is
a handful of fused kernels. Inputs are tensors only (ids, positions, slots, the block tables cut to the blocks in
use, lengths), so one graph serves every step; batch and table width are dynamic.
"""
from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from engine.kernels.cpu_gemv import CpuGemv, GemvOp
from engine.kv.layout import Layout
from engine.models.decoder import Decoder
from engine.runners.base import Row


class CompiledDecode:
    def __init__(self, model: Decoder, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 gemv: CpuGemv | None = None, windows: list[int] | None = None, layout: Layout | None = None) -> None:
        self.model, self.k_cache, self.v_cache, self.scale = model, k_cache, v_cache, scale
        self.layout = layout or Layout.of([0] * k_cache.shape[0])
        self.windows = windows or [0] * len(self.layout.group)
        if gemv is not None:
            model.use_gemv(GemvOp(gemv))                 # big weights: the graph calls the GEMV kernel
        if k_cache.device.type == "cpu":
            # Freezing makes the weights constants of the graph, prepacked for oneDNN. That costs a second copy of
            # the weights and buys a GEMV that reads them faster than eager F.linear does. It is inductor's global
            # switch (the per-compile option did not buy the same; docs/cpu-kernels.md), so it holds for
            # the process.
            inductor_config.freezing = True
        self.fn = torch.compile(self.step, dynamic=True, fullgraph=True)

    def __call__(self, ids: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Logits [B, V] of a decode step, one token per row (paged); `ids` are the input tokens on the device."""
        dev, bs = ids.device, self.k_cache.shape[2]
        width = -(-max(r.start + 1 for r in rows) // bs)          # blocks in use, not the tables' headroom
        kv = [[r.kv(g) for r in rows] for g in range(self.layout.groups)]
        tables = torch.tensor([[t[:width] + [0] * (width - min(width, len(t))) for _, t in per] for per in kv],
                              dtype=torch.long, device=dev)              # [groups, B, width]
        positions = torch.tensor([r.start for r in rows], dtype=torch.long, device=dev)
        slots = torch.tensor([[s[0] for s, _ in per] for per in kv], dtype=torch.long, device=dev)    # [groups, B]
        # The caches go in flat, [pages * num_blocks * block_size, n_kv, hd], so the graph writes new K/V into its
        # input in place: a write through a view of an input makes inductor copy the whole cache back each step.
        return self.fn(self.k_cache.view(-1, *self.k_cache.shape[3:]), self.v_cache.view(-1, *self.v_cache.shape[3:]),
                       ids, positions, slots, tables, positions + 1)

    def step(self, k_flat, v_flat, ids, positions, slots, tables, seq_lens) -> torch.Tensor:
        """Logits [B, V] (fp32) of one decode token per row; writes each row's new K/V at its slot."""
        m = self.model
        _, blocks, bs = self.k_cache.shape[:3]
        per_layer = blocks * bs
        ctx = tables.shape[2] * bs
        gqa = m.cfg.num_attention_heads != m.cfg.num_key_value_heads
        pos = torch.arange(ctx, device=ids.device)[None, :]
        visible = (pos < seq_lens[:, None])[:, None, None, :]
        masks = {w: visible & (pos >= seq_lens[:, None] - w)[:, None, None, :] for w in set(self.windows) if w}
        gather = (tables[:, :, :, None] * bs + torch.arange(bs, device=ids.device)).flatten(2)  # [G, B, ctx] slots
        group, page = self.layout.group, self.layout.slot

        def attend(layer: int, q, k, v):
            base, g = page[layer] * per_layer, group[layer]
            k_flat.index_put_((slots[g] + base,), k)
            v_flat.index_put_((slots[g] + base,), v)
            keys = k_flat[gather[g] + base]               # [B, ctx, n_kv, hd]
            values = v_flat[gather[g] + base]
            out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=masks.get(self.windows[layer], visible),
                                                 scale=self.scale,
                                                 enable_gqa=gqa)
            return out[:, :, 0]
        return m.logits(m.forward(ids, positions, attend))
