"""Decode's small ops on a CPU (cpu_pointwise.cpp), one ctypes call each, fp32 or bf16: RMSNorm (plus a residual,
or per head in place), RoPE, and greedy sampling's argmax. (The gated activation runs inside the down projection's
GEMV call: CpuGemv.fused.)"""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_build
from engine.kernels.cpu_gemv import DTYPES, MAX_ROWS

_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuPointwise:
    max_rows = MAX_ROWS     # decode steps, as for the GEMV; prefill chunks stay on torch's vectorised ops

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.norm_fns = {d: cpu_build.bind(lib, f"rms_norm_{n}", [_P, _P, ctypes.c_float, _P, _I, _I, ctypes.c_int,
                                                                   _P]) for d, n in DTYPES.items()}
        self.heads_fns = {d: cpu_build.bind(lib, f"norm_heads_{n}", [_P, _P, ctypes.c_float, _I, _I, _I, _I,
                                                                     ctypes.c_int]) for d, n in DTYPES.items()}
        self.rope_fns = {d: cpu_build.bind(lib, f"rope_{n}", [_P, _P, _P, _I, _I, _I, _I]) for d, n in DTYPES.items()}
        self.argmax_fn = cpu_build.bind(lib, "argmax_f32", [_P, _I, _I, _P])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm.forward for contiguous x [m, n] (fp32: F.rms_norm(x, weight.shape, weight, eps); Gemma's when
        `gemma`), plus `residual` [m, n] when given."""
        x = x.contiguous()
        out = torch.empty_like(x)
        res = None if residual is None else residual.contiguous().data_ptr()
        self.norm_fns[x.dtype](x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), x.shape[0], x.shape[1],
                               int(gemma), res)
        return out

    def norm_heads(self, x: torch.Tensor, norm, first: int, heads: int) -> None:
        """In place: heads [first, first + heads) of contiguous x [t, h, hd], each normalised by `norm` (an
        RMSNorm of hd: Qwen3's and Gemma 3's q/k norms)."""
        t, h, hd = x.shape
        self.heads_fns[x.dtype](x[:, first].data_ptr(), norm.weight.data_ptr(), norm.eps, t, heads, h * hd, hd,
                                int(norm.gemma))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int) -> None:
        """Rope.apply in place on heads [0, heads) of contiguous x [t, h, hd]; cos, signed_sin of [t, 1, hd]."""
        t, h, hd = x.shape
        self.rope_fns[x.dtype](x.data_ptr(), cos.contiguous().data_ptr(), signed_sin.contiguous().data_ptr(), t,
                               heads, h * hd, hd)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(-1) of contiguous fp32 x [m, n] (the first of equal values; the first NaN where there is one):
        one vectorised pass a row, where torch's argmax compares one value at a time (0.4 ms for a 262k vocabulary
        here, 7% of a Gemma 3 270M step)."""
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.argmax_fn(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out


def load() -> CpuPointwise | None:
    lib = cpu_build.library()
    return None if lib is None else CpuPointwise(lib)
