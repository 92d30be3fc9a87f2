"""Attention and KV-write ops behind one switch: the torch reference ops (any device), the Triton kernels (CUDA;
on CPU tensors only under TRITON_INTERPRET=1, which is how they are tested here), or, for fp32 and bf16 on an AVX2
CPU, the reference ops with decode's KV write and attention fused into one C call (`decode_step`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig, choices

CPU_DTYPES = ("float32", "bfloat16")
CALLS: Counter[str] = Counter()       # steps served per implementation: which one ran


@dataclass(slots=True, frozen=True)
class KernelOps:
    name: str                         # triton | reference
    write_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    decode_step: Callable | None = None   # write + attend for one token per row (cpu_attention.CpuDecode)


def select(choice: str, device_type: str, dtype: str = "", threads: int = 1) -> KernelOps:
    """choice auto | triton | reference | cpu; auto takes Triton on CUDA when it imports, the CPU kernel for fp32 and
    bf16 on a CPU when it builds, else the reference ops."""
    allowed = choices(EngineConfig, "attention")
    if choice not in allowed:
        raise ValueError(f"attention: must be one of {', '.join(allowed)}, got {choice!r}")
    if choice == "triton" or (choice == "auto" and device_type == "cuda"):
        try:
            from engine.kernels import triton_decode, triton_kv, triton_prefill
        except ImportError as e:
            if choice == "triton":
                raise ValueError(f"attention: triton is not installed ({e})") from None
        else:
            return KernelOps("triton", triton_kv.write_kv, triton_decode.paged_decode_attention,
                             triton_prefill.paged_prefill_attention)
    from engine.kernels import cpu_attention, reference
    if choice == "cpu" or (choice == "auto" and device_type == "cpu" and dtype in CPU_DTYPES):
        if device_type != "cpu" or dtype not in CPU_DTYPES:
            raise ValueError(f"attention: cpu needs float32 or bfloat16 on a CPU, got {dtype or '?'} on {device_type}")
        decode = cpu_attention.load(threads)
        if decode is not None:
            return KernelOps("cpu", reference.write_kv, reference.paged_decode_attention,
                             reference.paged_prefill_attention, decode)
        if choice == "cpu":
            raise ValueError("attention: cpu kernels are off or cannot be built here (see the log)")
    return KernelOps("reference", reference.write_kv, reference.paged_decode_attention,
                     reference.paged_prefill_attention)
