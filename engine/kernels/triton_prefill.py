"""Paged prefill attention in Triton: new tokens at positions start.. attend over the sequence's cached blocks plus
themselves, causally (and within a sliding window when given), reading K/V straight from the block table (a
prompt-cache hit's adopted prefix and a chunked prefill's earlier chunks alike). Grid (query tile, query head);
online softmax in fp32. Same signature as engine.kernels.reference.paged_prefill_attention."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _prefill(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, start, num_tokens, scale, window,
             stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
             stride_ot, stride_oh,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1)
    kvh = h // GROUP
    i, d, n = tile * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_SIZE)
    i_ok, d_ok = i < num_tokens, d < HEAD_DIM
    q = tl.load(q_ptr + i[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_pos = start + i
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = start + tl.minimum(tile * BLOCK_M + BLOCK_M, num_tokens)              # keys this tile can see
    lo = tl.where(window > 0, tl.maximum(start + tile * BLOCK_M - window + 1, 0), 0)
    for j in range(lo // BLOCK_SIZE, tl.cdiv(end, BLOCK_SIZE)):
        block = tl.load(table_ptr + j).to(tl.int64)
        k_pos = j * BLOCK_SIZE + n
        k_ok = (k_pos < end)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + n[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + block * stride_vb + n[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=k_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale            # [BLOCK_M, BLOCK_SIZE]
        visible = (k_pos[None, :] <= q_pos[:, None]) & i_ok[:, None]
        visible = visible & ((window == 0) | (k_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                    # rows past the tokens see nothing
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + i[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start: int, scale: float, window: int = 0) -> torch.Tensor:
    """q [T, nh, hd] at positions start..start+T-1; caches [num_blocks, block_size, n_kv, hd]; block_table [n]
    covers positions [0, start + T); a `window` limits the query at p to positions p - window + 1 .. p; returns
    [T, nh, hd]."""
    t, nh, hd = q.shape
    _, bs, nkv, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_prefill_attention: the head dimension must be contiguous")
    out = torch.empty_like(q)
    _prefill[(triton.cdiv(t, BLOCK_M), nh)](
        q, k_cache, v_cache, block_table, out, start, t, scale, window, q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        GROUP=nh // nkv, HEAD_DIM=hd, BLOCK_D=max(16, triton.next_power_of_2(hd)), BLOCK_M=BLOCK_M, BLOCK_SIZE=bs,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
