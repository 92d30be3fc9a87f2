"""Per-step attention for the MLX runner: write new K/V into the cache, then attend (gather + fast SDPA)."""
from __future__ import annotations

import mlx.core as mx

from engine.kv.layout import Layout
from engine.runners.base import Row, spans


def _sdpa(q: mx.array, k: mx.array, v: mx.array, start: int, scale: float, window: int = 0) -> mx.array:
    """q [T, nh, hd] at positions start.. over k/v [start+T, nkv, hd] (causal; with a `window`, the query at p sees
    p - window + 1 .. p only); returns [T, nh, hd]."""
    t, ctx = q.shape[0], k.shape[0]
    if window and ctx > window:
        first = max(0, start + 1 - window)            # nothing before it is visible to any query here
        k, v, start, ctx = k[first:], v[first:], start - first, ctx - first
    mask = None
    if t > 1 or (window and ctx > window):
        pos = (start + mx.arange(t))[:, None]
        keep = mx.arange(ctx)[None, :] <= pos
        if window:
            keep = keep & (mx.arange(ctx)[None, :] > pos - window)
        mask = mx.where(keep, 0.0, -mx.inf).astype(q.dtype)
    out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                               v.transpose(1, 0, 2)[None], scale=scale, mask=mask)
    return out[0].transpose(1, 0, 2)


def paged(k_cache: list[mx.array], v_cache: list[mx.array], block_size: int, rows: list[Row], scale: float,
          windows: list[int] | None = None, layout: Layout | None = None):
    """k_cache[page] is [num_blocks * block_size, nkv, hd]: a block is a run of block_size slots; windows[layer]:
    the positions that layer's queries see (0: all); `layout`: which group's slots and tables and which page each
    layer uses (None: one group, page = layer)."""
    layout = layout or Layout.of([0] * len(k_cache))
    windows = windows or [0] * len(layout.group)
    slots = [mx.array([s for r in rows for s in r.kv(g)[0]]) for g in range(layout.groups)]
    reads = [[] for _ in range(layout.groups)]
    for (o, n, start), r in zip(spans(rows), rows):
        ctx = start + n
        for g, found in enumerate(reads):
            lo = layout.first_needed(g, start)        # a sliding group's first position any of these queries sees
            table = mx.array(r.kv(g)[1][lo // block_size:-(-ctx // block_size)])
            # the slots of positions [lo, ctx): one gather per layer reads this row's context
            index = (table[:, None] * block_size + mx.arange(block_size)[None, :]).reshape(-1)
            found.append((o, n, start - lo, index[lo % block_size:lo % block_size + ctx - lo]))

    def attend(layer: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        g, p = layout.group[layer], layout.slot[layer]
        kc, vc = k_cache[p], v_cache[p]
        kc[slots[g]] = k               # scatter of the new positions only
        vc[slots[g]] = v
        outs = [_sdpa(q[o:o + n], kc[index], vc[index], start, scale, windows[layer])
                for o, n, start, index in reads[g]]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return attend


def dense(buffers: dict[int, list[list[mx.array]]], rows: list[Row], scale: float,
          windows: list[int] | None = None):
    """buffers[buf][layer] is [k, v], each [capacity, nkv, hd]; attention reads the first start+n positions."""
    parts = [(o, n, start, buffers[r.buf]) for (o, n, start), r in zip(spans(rows), rows)]

    def attend(layer: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        outs = []
        for o, n, start, buf in parts:
            kv = buf[layer]
            kv[0][start:start + n] = k[o:o + n]
            kv[1][start:start + n] = v[o:o + n]
            outs.append(_sdpa(q[o:o + n], kv[0][:start + n], kv[1][:start + n], start, scale,
                              windows[layer] if windows else 0))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return attend
