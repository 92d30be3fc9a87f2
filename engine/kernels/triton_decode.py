"""Paged decode attention in Triton: one query token per sequence over its block table, no gathered copy.

Grid (sequence, KV head, split). Each sequence's blocks are cut into `splits` equal runs, sized from its own
length on the device, so the grid depends only on the batch and the split count: a captured CUDA graph replays
it at any lengths. A program loads each K/V block of its run once for all the query heads of its KV group (GQA),
keeps a running max and sum (online softmax) in fp32, and writes its partial output and log-sum-exp; a run past
the sequence's end is empty. A second kernel merges the splits of each head by their log-sum-exp. Splitting the
context keeps a GPU busy when there are few sequences and long contexts.
Same signature as engine.kernels.reference.paged_decode_attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS = 128      # aim for at least this many programs (about one per SM) before splitting stops paying


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale, window,
             stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_tb,
             stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
             splits, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    g, d, n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + g
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)              # a sliding layer's first position
    seq_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    lo_block = lo // BLOCK_SIZE
    run = tl.cdiv(seq_blocks - lo_block, splits)
    first = lo_block + split * run
    last = tl.minimum(first + run, seq_blocks)
    for j in range(first, last):
        block = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
        valid = (j * BLOCK_SIZE + n < seq_len) & (j * BLOCK_SIZE + n >= lo)
        tile = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + n[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=tile, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + block * stride_vb + n[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=tile, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale          # [BLOCK_G, BLOCK_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))                               # finite: a block has a valid slot
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    has = denom > 0                                                                # false for an empty split
    out = acc / tl.where(has, denom, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, denom, 1.0)), float("-inf"))
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit
def _merge(part_ptr, lse_ptr, out_ptr, splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < splits, d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))                                      # split 0 always has tokens
    parts = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def splits_for(batch: int, kv_heads: int, blocks: int) -> int:
    """Splits of each sequence: enough to occupy ~PROGRAMS programs, never more than the longest has blocks."""
    return min(blocks, max(1, triton.cdiv(PROGRAMS, batch * kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_len: int | None = None, window: int = 0,
                           split_blocks: int | None = None) -> torch.Tensor:
    """q [B, nh, hd]; caches [num_blocks, block_size, n_kv, hd]; block_tables [B, max_blocks]; seq_lens [B].
    `max_len` (the largest seq_len, known on the host, or a bound of it) avoids a device sync; a `window` limits each
    query to its sequence's last `window` positions; `split_blocks` sets the split count to what cuts the longest
    sequence into runs of that many blocks."""
    b, nh, hd = q.shape
    _, bs, nkv, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the head dimension must be contiguous")
    max_len = int(seq_lens.max()) if max_len is None else max_len
    blocks = triton.cdiv(max_len, bs)
    splits = triton.cdiv(blocks, split_blocks) if split_blocks else splits_for(b, nkv, blocks)
    part = torch.empty((b, nh, splits, hd), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, nh, splits), dtype=torch.float32, device=q.device)
    group = nh // nkv
    block_d = max(16, triton.next_power_of_2(hd))
    _partial[(b, nkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, scale, window,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=hd, BLOCK_D=block_d,
        BLOCK_SIZE=bs, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    out = torch.empty_like(q)
    _merge[(b, nh)](part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                    lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=hd, BLOCK_D=block_d,
                    BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out
