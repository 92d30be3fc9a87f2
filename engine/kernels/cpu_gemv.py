"""The CPU decode GEMV (cpu_gemv.cpp), called through ctypes.

Eager torch reads fp32 weights at about half the memory bandwidth in a one-row F.linear; this kernel reads them at
close to it, and reads them once for up to MAX_ROWS rows. fp32 and bf16 (widened on load, or multiplied by
AVX512-BF16's vdpbf16ps where the CPU has it; fp32 accumulation, one rounding on store, as torch's CPU GEMM does).
ctypes drops the GIL for the call, so other Python threads (a server's responder) run while it streams the weights.
PAGODA_CPU_KERNELS=0 turns it off.
"""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_build

MAX_ROWS = 8            # above this a step is a prefill chunk: torch's GEMM is faster there
# Weights in blocks reach torch's GEMM only through a dequantized copy, which costs a 12-row decode step (a batch of
# 12, or speculation's verify rows) 4.5x an 8-row one (Gemma 3 270M Q4_K_M, 2 threads); up to this many rows they
# stay on the block GEMV, one pass over the weights for all rows
BLOCK_ROWS = 32
# ...but their int8 products are compute-bound past about this many rows: a step of 8 costs 2.4x a step of 1 on an
# AMD EPYC (AVX512-VNNI), 1.7x on an Intel Xeon with AMX, 4 rows 1.2-1.4x (perf.bench_rows, 2 threads). What a
# speculative verify step may fill (engine/core/speculate.py)
CHEAP_BLOCK_ROWS = 4
MIN_WEIGHT = 32768      # smaller weights (the tiny preset's) stay on torch: the ctypes call costs more than it saves
OP_MIN_BYTES = 2 << 20  # in a compiled graph: smaller weights stay on inductor's prepacked GEMM (see GemvOp)


DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}       # the C functions' suffixes
ACTS = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}           # a fused call's gated input (cpu_math.h's mode bits)
GEMMA_NORM = 4
Q8X = 8                                                       # blocks: x rounded to int8 (kernels/cpu_quant.cpp)
Q16X = 16                                                     # with Q8X: x as two int8 digits (about 16 bits)
MIXED = 32                                                    # with Q8X: the second digit where x's rounding errs most


class CpuGemv:
    """`gemv(x, weight, bias)` == F.linear(x, weight, bias) for contiguous fp32 or bf16 CPU tensors (one dtype),
    x of [m, k]."""
    max_rows = MAX_ROWS

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_int]
        self.fns = {dtype: cpu_build.bind(lib, f"gemv_{name}", args) for dtype, name in DTYPES.items()}
        fused = [*args, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
        self.fused_fns = {dtype: cpu_build.bind(lib, f"gemv_fused_{name}", fused) for dtype, name in DTYPES.items()}
        self.threads = threads

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        n, k = weight.shape
        y = torch.empty((x.shape[0], n), dtype=x.dtype)
        self.fns[weight.dtype](x.data_ptr(), x.shape[0], weight.data_ptr(), None if bias is None else bias.data_ptr(),
                               y.data_ptr(), n, k, self.threads)
        return y

    def fused(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, norm=None,
              act: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear with a decode layer's neighbours in the same call: of norm(x) (an RMSNorm: its weight, eps and
        style), or of act(gate) * up where x = [gate | up] (act: silu or gelu_pytorch_tanh); plus residual [m, n].
        Any size of weight; fp32 or bf16 (rounded after each op as the model's torch path rounds), or blocks
        (models/quant.QLinear, fp32)."""
        if not isinstance(weight, torch.Tensor):
            return weight.fused(x, bias, norm=norm, act=act, residual=residual)
        x = x.contiguous()
        n, k = weight.shape
        y = torch.empty((x.shape[0], n), dtype=x.dtype)
        residual = None if residual is None else residual.contiguous()
        self.fused_fns[weight.dtype](x.data_ptr(), x.shape[0], weight.data_ptr(),
                                     None if bias is None else bias.data_ptr(), y.data_ptr(), n, k, self.threads,
                                     None if norm is None else norm.weight.data_ptr(),
                                     0.0 if norm is None else norm.eps,
                                     ACTS[act] | (GEMMA_NORM if norm is not None and norm.gemma else 0),
                                     None if residual is None else residual.data_ptr())
        return y

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dtype in DTYPES and weight.is_contiguous() and weight.numel() >= MIN_WEIGHT


_OP_KERNEL: CpuGemv | None = None         # what pagoda::gemv runs; set by GemvOp


@torch.library.custom_op("pagoda::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _OP_KERNEL(x, weight, bias)


@gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class GemvOp:
    """The kernel as the torch op pagoda::gemv, so a torch.compile'd graph calls it instead of breaking on ctypes.
    The op costs more per call than ctypes, so it takes only weights too big for the cache (> OP_MIN_BYTES);
    the compiled graph's own prepacked GEMM serves the rest."""
    max_rows = MAX_ROWS

    def __init__(self, kernel: CpuGemv) -> None:
        global _OP_KERNEL
        _OP_KERNEL = kernel

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gemv_op(x, weight, bias)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return CpuGemv.fits(weight) and weight.numel() * weight.element_size() > OP_MIN_BYTES


def load(threads: int, target: str | None = None) -> CpuGemv | None:
    """The kernel on an x86 CPU with AVX2 and FMA (built for `target`, default this CPU's: cpu_build.isa), or None
    (turned off, other CPU, no compiler: torch serves)."""
    lib = cpu_build.library(target)
    return None if lib is None else CpuGemv(lib, threads)
