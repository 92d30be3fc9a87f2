"""Paged decode attention on a CPU (cpu_attention.cpp): KV write and attention of one layer in one ctypes call."""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_build
from engine.kernels.cpu_gemv import DTYPES

_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuDecode:
    """`decode(q, k, v, k_cache, v_cache, slots, tables, seq_lens, scale)`: writes k/v [B, n_kv, hd] at `slots` of
    the layer's caches [num_blocks, block_size, n_kv, hd], returns attention [B, nh, hd]; fp32 or bf16 (computed in
    fp32), contiguous."""

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        args = [_P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, ctypes.c_int]
        self.fns = {d: cpu_build.bind(lib, f"paged_decode_{n}", args) for d, n in DTYPES.items()}
        self.threads = threads

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        (b, nh, hd), n_kv, bs = q.shape, k.shape[1], k_cache.shape[1]
        out = torch.empty_like(q)
        self.fns[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), b, nh, n_kv, hd,
                          bs, scale, out.data_ptr(), self.threads)
        return out


def load(threads: int) -> CpuDecode | None:
    lib = cpu_build.library()
    return None if lib is None else CpuDecode(lib, threads)
