"""Every layer of a decode step in one ctypes call (cpu_layers.cpp), fp32 or bf16, over paged or dense KV.

The per-layer fused path (Layer.fused in models/decoder.py) makes six C calls a layer, and the Python between them
(module lookups, output tensors, the calls themselves) costs about 5 ms of a 0.5B step here. This makes one call
for all of them.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from engine.kernels import cpu_build
from engine.kernels.cpu_gemv import ACTS, BLOCK_ROWS, CHEAP_BLOCK_ROWS, DTYPES, GEMMA_NORM, MAX_ROWS

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Paged(NamedTuple):
    """What a paged decode step's attention needs, as the runner gives it (runners/torch/attention.py)."""
    k_cache: torch.Tensor             # [pages, num_blocks, block_size, n_kv, hd]
    v_cache: torch.Tensor
    slots: torch.Tensor               # [groups, B] int64: where each row's new K/V goes, per layer group
    tables: torch.Tensor              # [groups, B, width] int64 block ids
    seq_lens: torch.Tensor            # [B] int64, the new token included
    scale: float


class Dense(NamedTuple):
    """What a dense decode step's attention needs (runners/torch/attention.py): each row's own buffer."""
    buffers: list[torch.Tensor]       # row i's [layers, 2, capacity, n_kv, hd], contiguous
    seq_lens: torch.Tensor            # [B] int64, the new token included (it is written at seq_lens[i] - 1)
    scale: float


class _Dense(ctypes.Structure):
    _fields_ = [("bufs", _P), ("caps", _P)]


POINTERS = ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b", "down_w", "down_b", "input_norm", "post_norm",
            "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "qkv_q", "o_q", "gate_up_q", "down_q")


class Weights(ctypes.Structure):
    _fields_ = [*((name, _P) for name in POINTERS), ("window", _I), ("rope", _I), ("group", _I), ("page", _I)]


class Dims(ctypes.Structure):
    _fields_ = [*((name, _I) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size", "cache_layer", "mode")), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


def _ptr(t) -> int:
    """A weight's address; 0 (null) where the family has no such weight."""
    return 0 if t is None else t.data_ptr()


def _float(proj) -> int:
    return _ptr(proj.weight) if isinstance(proj.weight, torch.Tensor) else 0


def _blocks(proj) -> int:
    """A projection's Mat (models/quant.QLinear: weights in blocks), else null."""
    return 0 if isinstance(proj.weight, torch.Tensor) else ctypes.addressof(proj.mat())


def _weights(layer, window: int, rope: int, group: int, page: int) -> Weights:
    norm = lambda m: None if m is None else m.weight            # noqa: E731
    projs = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    return Weights(_float(layer.qkv), _ptr(layer.qkv.bias), _float(layer.o_proj), _ptr(layer.o_proj.bias),
                   _float(layer.gate_up), _ptr(layer.gate_up.bias), _float(layer.down),
                   _ptr(layer.down.bias), _ptr(layer.input_norm.weight), _ptr(layer.post_norm.weight),
                   _ptr(norm(layer.q_norm)), _ptr(norm(layer.k_norm)), _ptr(norm(layer.attn_out_norm)),
                   _ptr(norm(layer.mlp_out_norm)), *(_blocks(p) for p in projs), window, rope, group, page)


class CpuLayers:
    """`stack(x, tables, kv)`: x [m, hidden] through every layer of `layers` (the decoder's Layer modules), each
    with its RoPE tables (tables[i] of layer i: at most two distinct ones), KV written and attended through `kv`:
    Paged (layer i's KV: page pages[i] of the blocks of group groups[i]) or Dense (layer i's of each row's
    buffer); returns the result in x's storage. It holds the weights' addresses: the model that owns them holds it
    (Decoder.stack)."""
    max_rows = MAX_ROWS
    cheap_rows = MAX_ROWS     # rows a call takes at little more than one row's cost

    def __init__(self, lib: ctypes.CDLL, threads: int, layers, eps: float, windows: list[int] | None = None,
                 ropes: list[int] | None = None) -> None:
        """`windows`: each layer's sliding window (0: none); `ropes`: which RoPE (0 or 1) each layer takes. The KV
        layout is one group until `use_layout`."""
        self.fns = {d: cpu_build.bind(lib, f"decode_layers_{n}", [_P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P,
                                                                   _P, ctypes.c_int]) for d, n in DTYPES.items()}
        first = layers[0]
        windows, ropes = windows or [0] * len(layers), ropes or [0] * len(layers)
        self.second = ropes.index(1) if 1 in ropes else 0     # a layer whose tables are RoPE 1's
        self.weights = (Weights * len(layers))(*(_weights(layer, w, r, 0, i)
                                                 for i, (layer, w, r) in enumerate(zip(layers, windows, ropes))))
        mode = ACTS[first.act_name] | (GEMMA_NORM if first.input_norm.gemma else 0) | \
            (first.qkv.bits() if hasattr(first.qkv, "bits") else 0)
        self.dims = Dims(len(layers), first.o_proj.weight.shape[0], first.n_heads, first.n_kv, first.head_dim,
                         first.down.weight.shape[1], 0, 0, mode, eps, 0.0)
        self.threads = threads
        if hasattr(first.qkv, "kinds"):          # weights in blocks (models/quant.py): see BLOCK_ROWS
            self.max_rows, self.cheap_rows = BLOCK_ROWS, CHEAP_BLOCK_ROWS

    def use_layout(self, groups: tuple[int, ...], pages: tuple[int, ...]) -> None:
        """Each layer's KV group and page of a block (engine/kv/layout.py)."""
        for w, g, p in zip(self.weights, groups, pages):
            w.group, w.page = g, p

    def __call__(self, x: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
                 kv: Paged | Dense) -> torch.Tensor:
        """Up to max_rows rows in one call. A sequence's speculative rows come in position order; the attention
        writes every row's K/V before any row attends, so each row sees its sequence's earlier rows."""
        x = x.contiguous()
        pairs = [[t.contiguous() for t in tables[0]], [t.contiguous() for t in tables[self.second]]]
        cos = (_P * 2)(*(p[0].data_ptr() for p in pairs))
        signed_sin = (_P * 2)(*(p[1].data_ptr() for p in pairs))
        self.dims.scale = kv.scale
        if isinstance(kv, Dense):
            bufs = (_P * len(kv.buffers))(*(b.data_ptr() for b in kv.buffers))
            caps = (_I * len(kv.buffers))(*(b.shape[2] for b in kv.buffers))
            self.fns[x.dtype](self.weights, ctypes.byref(self.dims), x.data_ptr(), x.shape[0], cos, signed_sin,
                              None, None, None, None, 0, kv.seq_lens.data_ptr(), ctypes.byref(_Dense(
                                  ctypes.addressof(bufs), ctypes.addressof(caps))), self.threads)
            return x
        k_cache = kv.k_cache
        self.dims.block_size, self.dims.cache_layer = k_cache.shape[2], k_cache[0].numel()
        self.fns[x.dtype](self.weights, ctypes.byref(self.dims), x.data_ptr(), x.shape[0], cos, signed_sin,
                          k_cache.data_ptr(), kv.v_cache.data_ptr(), kv.slots.data_ptr(), kv.tables.data_ptr(),
                          kv.tables.shape[-1], kv.seq_lens.data_ptr(), None, self.threads)
        return x


def load(threads: int, layers, eps: float, windows: list[int] | None = None,
         ropes: list[int] | None = None) -> CpuLayers | None:
    lib = cpu_build.library()
    return None if lib is None else CpuLayers(lib, threads, layers, eps, windows, ropes)
