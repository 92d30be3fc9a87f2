"""Attention and KV-write ops behind one switch: the torch reference ops (any device) or the Triton kernels (CUDA;
on CPU tensors only under TRITON_INTERPRET=1, which is how they are tested here). Both have the same signatures."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

CALLS: Counter[str] = Counter()       # steps served per implementation: which one ran


@dataclass(slots=True, frozen=True)
class KernelOps:
    name: str                         # triton | reference
    write_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable


def select(choice: str, device_type: str) -> KernelOps:
    """choice auto | triton | reference; auto takes Triton on CUDA when it imports, else the reference ops."""
    if choice not in ("auto", "triton", "reference"):
        raise ValueError(f"attention: must be auto, triton or reference, got {choice!r}")
    if choice == "triton" or (choice == "auto" and device_type == "cuda"):
        try:
            from engine.kernels import triton_decode, triton_kv, triton_prefill
        except ImportError as e:
            if choice == "triton":
                raise ValueError(f"attention: triton is not installed ({e})") from None
        else:
            return KernelOps("triton", triton_kv.write_kv, triton_decode.paged_decode_attention,
                             triton_prefill.paged_prefill_attention)
    from engine.kernels import reference
    return KernelOps("reference", reference.write_kv, reference.paged_decode_attention,
                     reference.paged_prefill_attention)
