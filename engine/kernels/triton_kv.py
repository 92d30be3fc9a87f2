"""KV write in Triton: each new token's K and V go into their cache slots in place (slot = block * size + offset).
Same signature as engine.kernels.reference.write_kv."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
           stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
           KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h, d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + block * stride_db + offset * stride_ds + h[:, None] * stride_dh + d[None, :], v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new K/V [T, n_kv, hd] into caches [num_blocks, block_size, n_kv, hd] at flat `slots` [T]."""
    t, nkv, hd = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv: the head dimension must be contiguous")
    _write[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 *k_cache.stride()[:3], *v_cache.stride()[:3],
                 KV_HEADS=nkv, BLOCK_H=triton.next_power_of_2(nkv), HEAD_DIM=hd,
                 BLOCK_D=triton.next_power_of_2(hd), BLOCK_SIZE=k_cache.shape[1])
