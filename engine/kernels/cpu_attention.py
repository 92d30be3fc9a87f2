"""Paged decode attention on a CPU (cpu_attention.cpp): KV write and attention of one layer in one ctypes call."""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_build
from engine.kernels.cpu_gemv import DTYPES

_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuDecode:
    """`decode(q, k, v, k_cache, v_cache, slots, tables, seq_lens, scale, window)`: writes k/v [B, n_kv, hd] at
    `slots` of the layer's caches [num_blocks, block_size, n_kv, hd], returns attention [B, nh, hd] (contiguous)
    over each row's last `window` positions (0: all); fp32 or bf16 (computed in fp32)."""

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        args = [_P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, ctypes.c_int]
        self.fns = {d: cpu_build.bind(lib, f"paged_decode_{n}", args) for d, n in DTYPES.items()}
        self.threads = threads

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, window: int = 0) -> torch.Tensor:
        q, k, v = (rows(t) for t in (q, k, v))
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        (b, nh, hd), n_kv, bs = q.shape, k.shape[1], k_cache.shape[1]
        out = torch.empty((b, nh, hd), dtype=q.dtype)
        self.fns[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), k_cache.data_ptr(),
                          v_cache.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                          seq_lens.data_ptr(), b, nh, n_kv, hd, bs, scale, window, out.data_ptr(), self.threads)
        return out


def rows(t: torch.Tensor) -> torch.Tensor:
    """t [B, heads, hd] as the kernel reads it: each row's heads contiguous, rows any stride apart (the q, k and v
    slices of one QKV output as they are), else a contiguous copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def load(threads: int) -> CpuDecode | None:
    lib = cpu_build.library()
    return None if lib is None else CpuDecode(lib, threads)
