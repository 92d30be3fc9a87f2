"""Every layer of a paged decode step in one ctypes call (cpu_layers.cpp), fp32 or bf16.

The per-layer fused path (Layer.fused in models/decoder.py) makes six C calls a layer, and the Python between them
(module lookups, output tensors, the calls themselves) costs about 5 ms of a 0.5B step here. This makes one call
for all of them; Layer.fused still serves dense KV, whose rows each have their own buffer.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from engine.kernels import cpu_build
from engine.kernels.cpu_gemv import DTYPES, MAX_ROWS

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Paged(NamedTuple):
    """What a paged decode step's attention needs, as the runner gives it (runners/torch/attention.py)."""
    k_cache: torch.Tensor             # [layers, num_blocks, block_size, n_kv, hd]
    v_cache: torch.Tensor
    slots: torch.Tensor               # [B] int64: where each row's new K/V goes
    tables: torch.Tensor              # [B, width] int64 block ids
    seq_lens: torch.Tensor            # [B] int64, the new token included
    scale: float


class Weights(ctypes.Structure):
    _fields_ = [*((name, _P) for name in ("qkv_w", "qkv_b", "o_w", "gate_up_w", "down_w", "input_norm",
                                          "post_norm")), ("window", _I)]


class Dims(ctypes.Structure):
    _fields_ = [*((name, _I) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size", "cache_layer")), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


class CpuLayers:
    """`stack(x, rope, paged)`: x [m, hidden] through every layer of `layers` (the decoder's Layer modules, of a
    family whose layer the kernels compute: Layer.plain), KV written and attended through `paged`; returns the
    result in x's storage. It holds the weights' addresses: the model that owns them holds it (Decoder.stack)."""
    max_rows = MAX_ROWS

    def __init__(self, lib: ctypes.CDLL, threads: int, layers, eps: float, windows: list[int] | None = None) -> None:
        self.fns = {d: cpu_build.bind(lib, f"decode_layers_{n}", [_P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P,
                                                                   ctypes.c_int]) for d, n in DTYPES.items()}
        first = layers[0]
        windows = windows or [0] * len(layers)
        self.weights = (Weights * len(layers))(*(Weights(
            layer.qkv.weight.data_ptr(), 0 if layer.qkv.bias is None else layer.qkv.bias.data_ptr(),
            layer.o_proj.weight.data_ptr(), layer.gate_up.weight.data_ptr(), layer.down.weight.data_ptr(),
            layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(), window)
            for layer, window in zip(layers, windows)))
        self.dims = Dims(len(layers), first.o_proj.weight.shape[0], first.n_heads, first.n_kv, first.head_dim,
                         first.down.weight.shape[1], 0, 0, eps, 0.0)
        self.threads = threads

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], paged: Paged) -> torch.Tensor:
        x = x.contiguous()
        cos, signed_sin = (t.contiguous() for t in rope)
        k_cache = paged.k_cache
        self.dims.block_size, self.dims.scale = k_cache.shape[2], paged.scale
        self.dims.cache_layer = k_cache[0].numel()
        self.fns[x.dtype](self.weights, ctypes.byref(self.dims), x.data_ptr(), x.shape[0], cos.data_ptr(),
                          signed_sin.data_ptr(), k_cache.data_ptr(), paged.v_cache.data_ptr(), paged.slots.data_ptr(),
                          paged.tables.data_ptr(), paged.tables.shape[1], paged.seq_lens.data_ptr(), self.threads)
        return x


def load(threads: int, layers, eps: float, windows: list[int] | None = None) -> CpuLayers | None:
    lib = cpu_build.library()
    return None if lib is None else CpuLayers(lib, threads, layers, eps, windows)
