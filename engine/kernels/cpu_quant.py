"""The GEMV over GGUF's blocks (cpu_quant.cpp), called through ctypes: fp32 rows times a weight kept in llama.cpp's
block formats, and those blocks dequantized to fp32 (an embedding's rows; prefill's GEMM, a slice at a time)."""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_build

_P, _I = ctypes.c_void_p, ctypes.c_int64
# GGML's type ids the kernels read, by name; each with (weights, bytes) a block
TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q8_0": 8, "Q4_0": 2, "Q5_0": 6, "Q4_K": 12, "Q6_K": 14}
BLOCKS = {0: (32, 128), 1: (32, 64), 30: (32, 64), 8: (32, 34), 2: (32, 18), 6: (32, 22), 12: (256, 144),
          14: (256, 210)}


class Part(ctypes.Structure):
    _fields_ = [("data", _P), ("type", _I), ("rows", _I), ("row_bytes", _I), ("packed", _I)]


class Mat(ctypes.Structure):
    _fields_ = [("parts", _I), ("part", Part * 3)]


class CpuQuant:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fused_fn = cpu_build.bind(lib, "qgemv_fused", [_P, _I, _P, _P, _P, _I, _I, ctypes.c_int, _P,
                                                             ctypes.c_float, ctypes.c_int, _P])
        self.dequant_fn = cpu_build.bind(lib, "qdequant", [_P, _I, _I, _I, _P, ctypes.c_int])
        self.rows_fn = cpu_build.bind(lib, "qrows", [_P, _P, _I, _I, _P])
        self.pack_fn = cpu_build.bind(lib, "qpack", [_P, _I, _I, _P], restype=_I)
        self.gemm16_fn = cpu_build.bind(lib, "qgemm16", [_P, _I, _P, _P, _P, _I, _I, ctypes.c_int],
                                        restype=ctypes.c_int)

    def fused(self, x: torch.Tensor, mat: Mat, n: int, k: int, bias: torch.Tensor | None, norm_ptr: int | None,
              eps: float, mode: int, residual: torch.Tensor | None) -> torch.Tensor:
        """y [m, n] = x (fp32, contiguous; [m, k], or [m, 2k] when gated) through cpu_gemv's fused input (mode, norm)
        times the blocks of w [n, k]."""
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        self.fused_fn(x.data_ptr(), x.shape[0], ctypes.byref(mat), None if bias is None else bias.data_ptr(),
                      y.data_ptr(), n, k, torch.get_num_threads(), norm_ptr, eps, mode,
                      None if residual is None else residual.data_ptr())
        return y

    def gemm16(self, x: torch.Tensor, mat: Mat, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor | None:
        """y [m, n] = x (fp32 [m, k]) times packed blocks, x rounded to int16 per 32 values (VNNI's int16 products);
        None where the build has no AVX512-VNNI or a part is not whole packed groups."""
        x, y = x.contiguous(), torch.empty((x.shape[0], n), dtype=torch.float32)
        done = self.gemm16_fn(x.data_ptr(), x.shape[0], ctypes.byref(mat), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), n, k, torch.get_num_threads())
        return y if done else None

    def dequant(self, mat: Mat, first: int, rows: int, k: int) -> torch.Tensor:
        out = torch.empty((rows, k), dtype=torch.float32)
        self.dequant_fn(ctypes.byref(mat), first, rows, k, out.data_ptr(), torch.get_num_threads())
        return out

    def pack(self, mat: Mat, i: int, k: int) -> torch.Tensor | None:
        """Part i's bytes with its rows interleaved in groups of 8 (cpu_packed.h), or None for a type not packed."""
        size = self.pack_fn(ctypes.byref(mat), i, k, None)
        if size == 0:
            return None
        out = torch.empty(size, dtype=torch.uint8)
        self.pack_fn(ctypes.byref(mat), i, k, out.data_ptr())
        return out

    def rows(self, mat: Mat, ids: torch.Tensor, k: int) -> torch.Tensor:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((ids.shape[0], k), dtype=torch.float32)
        self.rows_fn(ctypes.byref(mat), ids.data_ptr(), ids.shape[0], k, out.data_ptr())
        return out


def load() -> CpuQuant | None:
    """The kernels on an x86 CPU with AVX2, FMA and F16C, or None (turned off, other CPU, no compiler)."""
    lib = cpu_build.library()
    return None if lib is None else CpuQuant(lib)
