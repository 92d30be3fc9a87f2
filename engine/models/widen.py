"""bf16 GEMMs computed in fp32, for prefill on CPUs without bf16 arithmetic (no AVX512-BF16, no AMX).

There torch multiplies bf16 matrices about five times slower than it widens them and multiplies in fp32 (a
512 x 896 x 4864 GEMM on an AVX2 AMD EPYC, 2 threads: 10.9 against 57.9 GFLOP/s; docs/cpu-kernels.md). The product
is the same: the bf16 values widen exactly, torch's bf16 GEMM accumulates in fp32 too, and the result is rounded to
bf16 once; only the order of the additions may differ. The weight widens a slice of rows at a time, so no fp32 copy
of a large matrix (a 150k-row head) is ever whole.
"""
from __future__ import annotations

import torch

from engine.kernels import cpu_build

SLICE_BYTES = 8 << 20     # the fp32 slice of a weight widened (here) or dequantized (quant.py) per GEMM


def wanted(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prefill's GEMMs in `dtype` on `device` should go through `linear`."""
    return dtype == torch.bfloat16 and device.type == "cpu" and not cpu_build.native_bf16()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in x's dtype, computed in fp32 a slice of weight's rows at a time."""
    n, k = weight.shape
    step = max(1, SLICE_BYTES // (4 * k))
    xf = x.float()
    if step >= n:
        out = xf @ weight.float().T
    else:
        out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        for first in range(0, n, step):
            out[..., first:first + step] = xf @ weight[first:first + step].float().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
