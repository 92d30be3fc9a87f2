"""Per-step attention for the torch runner: write new K/V in place, then attend over paged or dense KV."""
from __future__ import annotations

import torch

from engine.kernels import CALLS, KernelOps
from engine.kernels import reference as ref
from engine.kernels.cpu_layers import Dense, Paged
from engine.kv.layout import Layout
from engine.runners.base import Row, spans
from engine.runners.torch.host import upload


def paged(ops: KernelOps, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: list[Row], scale: float,
          device: torch.device, windows: list[int] | None = None, layout: Layout | None = None):
    """k_cache/v_cache [pages, num_blocks, block_size, n_kv, hd]; `ops` are the reference ops or the kernels;
    windows[layer]: the positions that layer's queries see (0: all; None: 0 for every layer); `layout`: which
    group's slots and tables and which page each layer uses (None: one group, page = layer)."""
    layout = layout or Layout.of([0] * k_cache.shape[0])
    windows = windows or [0] * len(layout.group)
    group, page, n_groups = layout.group, layout.slot, layout.groups
    CALLS[ops.name] += 1
    if all(r.length == 1 for r in rows):
        kv = [[r.kv(g) for r in rows] for g in range(n_groups)]
        width = max(len(t) for per in kv for _, t in per)
        flat = [s for per in kv for slots, _ in per for s in slots]
        for per in kv:
            for _, t in per:
                flat += t + [0] * (width - len(t))
        flat += [r.start + 1 for r in rows]
        b = len(rows)
        host = upload(flat, device)
        slots = host[:n_groups * b].view(n_groups, b)
        tables = host[n_groups * b:-b].view(n_groups, b, width)
        seq_lens = host[-b:]
        max_len = max(r.start + 1 for r in rows)

        if ops.decode_step is not None:
            def fused(layer: int, q, k, v):
                g, p = group[layer], page[layer]
                return ops.decode_step(q, k, v, k_cache[p], v_cache[p], slots[g], tables[g], seq_lens, scale,
                                       windows[layer])
            fused.paged = Paged(k_cache, v_cache, slots, tables, seq_lens, scale)     # for cpu_layers: all layers
            return fused

        def decode(layer: int, q, k, v):
            g, p = group[layer], page[layer]
            ops.write_kv(k_cache[p], v_cache[p], slots[g], k, v)
            return ops.paged_decode_attention(q, k_cache[p], v_cache[p], tables[g], seq_lens, scale, max_len,
                                              windows[layer])
        return decode

    parts = spans(rows)
    slots = [upload([s for r in rows for s in r.kv(g)[0]], device) for g in range(n_groups)]
    tables = [[upload(r.kv(g)[1], device) for r in rows] for g in range(n_groups)]

    def prefill(layer: int, q, k, v):
        g, p = group[layer], page[layer]
        ops.write_kv(k_cache[p], v_cache[p], slots[g], k, v)
        outs = [ops.paged_prefill_attention(q[o:o + n], k_cache[p], v_cache[p], table, start, scale, windows[layer])
                for (o, n, start), table in zip(parts, tables[g])]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return prefill


def dense(buffers: dict[int, torch.Tensor], rows: list[Row], scale: float, windows: list[int] | None = None):
    """Each buffer is [layers, 2, capacity, n_kv, hd]; attention reads a view of it, no copy. A decode step (one
    token a row) carries `dense` too: what cpu_layers needs to run every layer in one call."""
    parts = [(o, n, start, buffers[r.buf]) for (o, n, start), r in zip(spans(rows), rows)]

    def attend(layer: int, q, k, v):
        outs = []
        for o, n, start, buf in parts:
            buf[layer, 0, start:start + n] = k[o:o + n]
            buf[layer, 1, start:start + n] = v[o:o + n]
            outs.append(ref.causal_attention(q[o:o + n], buf[layer, 0, :start + n], buf[layer, 1, :start + n],
                                             start, scale, windows[layer] if windows else 0))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    if all(r.length == 1 for r in rows):
        attend.dense = Dense([buf for *_, buf in parts], torch.tensor([r.start + 1 for r in rows]), scale)
    return attend

