"""Per-step attention for the torch runner: write new K/V in place, then attend over paged or dense KV."""
from __future__ import annotations

import torch

from engine.kernels import CALLS, KernelOps
from engine.kernels import reference as ref
from engine.kernels.cpu_layers import Paged
from engine.runners.base import Row, spans
from engine.runners.torch.host import upload


def paged(ops: KernelOps, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: list[Row], scale: float,
          device: torch.device, windows: list[int] | None = None):
    """k_cache/v_cache [layers, num_blocks, block_size, n_kv, hd]; `ops` are the reference ops or the kernels;
    windows[layer]: the positions that layer's queries see (0: all; None: 0 for every layer)."""
    windows = windows or [0] * k_cache.shape[0]
    CALLS[ops.name] += 1
    slots = upload([s for r in rows for s in r.slots], device)
    if all(r.length == 1 for r in rows):
        width = max(len(r.block_table) for r in rows)
        tables = upload([r.block_table + [0] * (width - len(r.block_table)) for r in rows], device)
        lens = [r.start + 1 for r in rows]
        seq_lens = upload(lens, device)
        max_len = max(lens)

        if ops.decode_step is not None:
            def fused(layer: int, q, k, v):
                return ops.decode_step(q, k, v, k_cache[layer], v_cache[layer], slots, tables, seq_lens, scale,
                                       windows[layer])
            fused.paged = Paged(k_cache, v_cache, slots, tables, seq_lens, scale)     # for cpu_layers: all layers
            return fused

        def decode(layer: int, q, k, v):
            ops.write_kv(k_cache[layer], v_cache[layer], slots, k, v)
            return ops.paged_decode_attention(q, k_cache[layer], v_cache[layer], tables, seq_lens, scale, max_len,
                                              windows[layer])
        return decode

    parts = spans(rows)
    tables = [upload(r.block_table, device) for r in rows]

    def prefill(layer: int, q, k, v):
        ops.write_kv(k_cache[layer], v_cache[layer], slots, k, v)
        outs = [ops.paged_prefill_attention(q[o:o + n], k_cache[layer], v_cache[layer], table, start, scale,
                                            windows[layer])
                for (o, n, start), table in zip(parts, tables)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return prefill


def dense(buffers: dict[int, torch.Tensor], rows: list[Row], scale: float, windows: list[int] | None = None):
    """Each buffer is [layers, 2, capacity, n_kv, hd]; attention reads a view of it, no copy."""
    parts = [(o, n, start, buffers[r.buf]) for (o, n, start), r in zip(spans(rows), rows)]

    def attend(layer: int, q, k, v):
        outs = []
        for o, n, start, buf in parts:
            buf[layer, 0, start:start + n] = k[o:o + n]
            buf[layer, 1, start:start + n] = v[o:o + n]
            outs.append(ref.causal_attention(q[o:o + n], buf[layer, 0, :start + n], buf[layer, 1, :start + n],
                                             start, scale, windows[layer] if windows else 0))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return attend

