"""Torch reference ops: KV writes in place, attention over a block table (one gather) or a dense buffer."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new K/V [T, n_kv, hd] into caches [num_blocks, block_size, n_kv, hd] at flat `slots` [T]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                     window: int = 0) -> torch.Tensor:
    """q [T, nh, hd] at positions start..start+T-1 over k/v [start+T, n_kv, hd]; returns [T, nh, hd]. With a
    `window`, the query at p sees positions p - window + 1 .. p only."""
    t, ctx = q.shape[0], k.shape[0]
    mask, causal = None, False
    if window and ctx > window:
        first = max(0, start + 1 - window)            # nothing before it is visible to any query here
        k, v, start, ctx = k[first:], v[first:], start - first, ctx - first
        pos = start + torch.arange(t, device=q.device)[:, None]
        keys = torch.arange(ctx, device=q.device)[None, :]
        mask = (keys <= pos) & (keys > pos - window)
    elif t > 1 and start == 0:
        causal = True
    elif t > 1:
        mask = torch.arange(ctx, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of a sequence's blocks as one [length, n_kv, hd] tensor."""
    bs = cache.shape[1]
    n = -(-length // bs)
    return cache[block_table[:n]].flatten(0, 1)[:length]


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start: int, scale: float, window: int = 0) -> torch.Tensor:
    """New tokens q [T, nh, hd] at positions start.. over the cached prefix plus themselves (causal, and within
    `window` positions when one is given: blocks wholly before the first query's window are not read)."""
    ctx, bs = start + q.shape[0], k_cache.shape[1]
    skip = max(0, start + 1 - window) // bs if window else 0
    k = gather_blocks(k_cache, block_table[skip:], ctx - skip * bs)
    v = gather_blocks(v_cache, block_table[skip:], ctx - skip * bs)
    return causal_attention(q, k, v, start - skip * bs, scale, window)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_len: int | None = None,
                           window: int = 0) -> torch.Tensor:
    """One query token per sequence, q [B, nh, hd], over its block table [B, max_blocks] (its last `window`
    positions only, when given); returns [B, nh, hd]."""
    bs = k_cache.shape[1]
    max_len = int(seq_lens.max()) if max_len is None else max_len
    n = -(-max_len // bs)
    k = k_cache[block_tables[:, :n]].flatten(1, 2)[:, :max_len]        # [B, L, n_kv, hd]
    v = v_cache[block_tables[:, :n]].flatten(1, 2)[:, :max_len]
    # masked even for one row: `max_len` may be a bound above its length (a graph's fixed width)
    pos = torch.arange(max_len, device=q.device)[None, :]
    mask = pos < seq_lens[:, None]
    if window:
        mask = mask & (pos >= seq_lens[:, None] - window)
    mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[2])
    return out[:, :, 0]
