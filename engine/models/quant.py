"""Weights kept in GGUF's block formats (llama.cpp's Q8_0, Q4_0, Q5_0, Q4_K, Q6_K; F32, F16 and BF16 beside them):
one more kind of linear layer, and an embedding that reads its rows from the same blocks.

A projection's weight is one uint8 parameter holding its parts' blocks one after another (a fused projection may
stack parts of different types: Q4_K_M keeps v in Q6_K beside q and k in Q4_K), so the huge-page packing moves it
like any other weight. Decode's few rows multiply the blocks directly (kernels/cpu_quant.cpp); prefill's many rows
too where the CPU has AVX512-VNNI (int16 x, kernels/cpu_gemm16.h), else they dequantize a slice of the weight at a
time and multiply with torch's GEMM. Activations are fp32 between the layers.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import cpu_build, cpu_quant
from engine.kernels.cpu_gemv import ACTS, BLOCK_ROWS, GEMMA_NORM, MAX_ROWS, MIXED, Q8X, Q16X
from engine.models.widen import SLICE_BYTES  # prefill: the fp32 slice of a weight dequantized per GEMM


def prefill_dtype() -> torch.dtype:
    """Prefill's GEMM type beside int8 activations where prefill16 is not: bf16 where the CPU multiplies it
    natively (AVX512-BF16, AMX), about twice fp32's speed there and no lossier than decode's int8; else fp32."""
    return torch.bfloat16 if cpu_build.native_bf16() else torch.float32


@functools.cache
def prefill16(split: bool) -> bool:
    """Whether prefill beside integer activations (split: int16) multiplies x rounded to int16 per 32 values by the
    blocks' integers (VNNI's int16 products, kernels/cpu_gemm16.h): where the CPU has AVX512-VNNI, as fast as
    torch's bf16 GEMM or faster and about as exact as fp32 (docs/models.md), except beside int8 and mixed on a CPU
    with AMX, whose bf16 tiles torch's GEMM runs on, faster still."""
    return cpu_build.vnni() and (split or "amx_bf16" not in cpu_build.cpu_flags())


@dataclass(slots=True)
class Blocks:
    """One tensor as the file holds it: GGML type id, bytes [rows, row_bytes], k weights a row."""
    type: int
    data: torch.Tensor
    k: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @staticmethod
    def of(weight: torch.Tensor) -> Blocks:
        """A float tensor as F32 blocks (beside quantized parts of the same projection)."""
        w = weight.detach().to(torch.float32).contiguous()
        return Blocks(cpu_quant.TYPES["F32"], w.view(torch.uint8).reshape(w.shape[0], -1), w.shape[1])


class QLinear(nn.Module):
    """y = x @ w.T + bias, w [n, k] in blocks. It is its own `weight` (shape, dtype), so code that passes a
    projection's weight to a GEMV passes it. `int8`: decode rounds x to int8 per 32 values for the dot products
    with quantized blocks (llama.cpp's way; the loader sets it from quantized_activations); else x stays fp32.
    `split` (with int8): x as two int8 digits, value and remainder, about 16 bits; `mixed` (with int8): the second
    digit only for the blocks of x that carry most of the first's rounding error (kernels/cpu_quant.cpp)."""
    int8 = True
    split = False
    mixed = False
    triton = False            # forward and rows through kernels/triton_quant.py, as where the blocks are on a GPU

    def __init__(self, parts: list[Blocks], bias: torch.Tensor | None, kernel: cpu_quant.CpuQuant) -> None:
        super().__init__()
        if len(parts) > 3:
            raise ValueError("model: a projection of more than three parts")
        # per part: type, rows, bytes a row in the file's layout, bytes in all, whether packed (pack())
        self.kinds = [(p.type, p.rows, p.data.shape[1], p.data.numel(), 0) for p in parts]
        self.blocks = nn.Parameter(torch.cat([p.data.reshape(-1) for p in parts]), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.shape = torch.Size((sum(p.rows for p in parts), parts[0].k))
        self.kernel = kernel
        self._mat: tuple[int, cpu_quant.Mat] | None = None

    weight = property(lambda self: self)

    def bits(self) -> int:
        """Decode's x against these blocks as the C kernels' mode bits (cpu_math.h)."""
        return (Q8X if self.int8 else 0) | (Q16X if self.split else 0) | (MIXED if self.mixed else 0)
    dtype = torch.float32

    def mat(self) -> cpu_quant.Mat:
        """The C description of the parts, remade when the bytes move (hugepages.pack)."""
        base = self.blocks.data_ptr()
        if self._mat is None or self._mat[0] != base:
            mat, offset = cpu_quant.Mat(len(self.kinds)), 0
            for i, (kind, rows, row_bytes, size, packed) in enumerate(self.kinds):
                mat.part[i] = cpu_quant.Part(base + offset, kind, rows, row_bytes, packed)
                offset += size
            self._mat = (base, mat)
        return self._mat[1]

    def pack(self) -> None:
        """Interleave the quantized parts' rows in groups of 8 for decode's integer GEMV (kernels/cpu_packed.h):
        the same bytes, about 3x fewer instructions a weight. Packed parts take x in int8 only."""
        pieces, mat, k = [], self.mat(), self.shape[1]
        for i, (kind, rows, row_bytes, size, _) in enumerate(self.kinds):
            packed = self.kernel.pack(mat, i, k)
            start = sum(s for _, _, _, s, _ in self.kinds[:i])
            pieces.append(self.blocks.data[start:start + size] if packed is None else packed)
            if packed is not None:
                self.kinds[i] = (kind, rows, row_bytes, packed.numel(), 1)
        self.blocks = nn.Parameter(torch.cat(pieces), requires_grad=False)
        self._mat = None

    def fused(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, norm=None, act: str | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """As CpuGemv.fused: of norm(x) or act(gate) * up, plus residual; for a decode step's rows."""
        mode = ACTS[act] | (GEMMA_NORM if norm is not None and norm.gemma else 0) | self.bits()
        return self.kernel.fused(x.contiguous(), self.mat(), *self.shape, bias,
                                 None if norm is None else norm.weight.data_ptr(), 0.0 if norm is None else norm.eps,
                                 mode, None if residual is None else residual.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton or self.blocks.device.type != "cpu":       # the Triton kernels; x stays float, no int8
            from engine.kernels import triton_quant
            n, k = self.shape
            if x.shape[0] <= MAX_ROWS:
                out = triton_quant.gemv(x, self.blocks, self.kinds, (n, k))
            else:
                out, step = torch.empty((x.shape[0], n), device=x.device), max(1, SLICE_BYTES // (4 * k))
                for first in range(0, n, step):
                    w = triton_quant.dequant(self.blocks, self.kinds, k, first, min(step, n - first))
                    out[:, first:first + w.shape[0]] = x.float() @ w.T
            return out if self.bias is None else out.add_(self.bias)
        if x.shape[0] <= BLOCK_ROWS:
            return self.fused(x, self.bias)
        n, k = self.shape
        if self.int8 and self.kernel is not None and prefill16(self.split):
            out = self.kernel.gemm16(x, self.mat(), n, k, self.bias)
            if out is not None:
                return out
        return self.sliced(x, prefill_dtype() if self.int8 and not self.split else torch.float32)

    def sliced(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x @ w.T + bias through torch's GEMM in `dtype`, w dequantized a slice at a time."""
        n, k = self.shape
        step = max(8, SLICE_BYTES // (4 * k) // 8 * 8)          # whole groups of packed rows
        out, xd = torch.empty((x.shape[0], n), dtype=torch.float32), x.to(dtype)
        for first in range(0, n, step):
            rows = min(step, n - first)
            out[:, first:first + rows] = xd @ self.kernel.dequant(self.mat(), first, rows, k).to(dtype).T
        return out if self.bias is None else out.add_(self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of w in fp32, [*ids.shape, k] (an embedding's lookup)."""
        if self.triton or self.blocks.device.type != "cpu":
            from engine.kernels import triton_quant
            return triton_quant.take(self.blocks, self.kinds, self.shape[1], ids.reshape(-1)).view(*ids.shape, -1)
        return self.kernel.rows(self.mat(), ids, self.shape[1]).view(*ids.shape, self.shape[1])


class QEmbedding(nn.Module):
    """nn.Embedding over blocks; `weight` is the QLinear a tied head multiplies with."""

    def __init__(self, table: QLinear) -> None:
        super().__init__()
        self.table = table

    weight = property(lambda self: self.table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized(tensors: Iterable[tuple[str, torch.Tensor]], kind: str) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
    """A Hugging Face checkpoint's tensors with its projections' weights quantized into `kind` (q8_0 | q4_0) by
    gguf-py (llama.cpp's reference quantizers), the embedding and head into Q8_0; a weight whose rows are not whole
    blocks stays float, as llama.cpp leaves it."""
    import gguf
    for name, tensor in tensors:
        stem = name.rsplit(".", 2)
        head = name in ("model.embed_tokens.weight", "lm_head.weight")
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0 and (head or (stem[-1] == "weight" and
                                                                          stem[-2] in _PROJECTIONS)):
            qt = gguf.GGMLQuantizationType.Q8_0 if head else gguf.GGMLQuantizationType[kind.upper()]
            raw = gguf.quantize(tensor.float().numpy(), qt)
            yield name, Blocks(int(qt), torch.from_numpy(raw), tensor.shape[1])
        else:
            yield name, tensor


def install(model: nn.Module, name: str, parts: list[Blocks], kernel: cpu_quant.CpuQuant, acts: str = "mixed") -> None:
    """Put the blocks of parameter `name` (a Linear's or the Embedding's weight) in place of that module; `acts`:
    decode's x against them (quantized_activations: int8, mixed, int16 or float32)."""
    path, _, _ = name.rpartition(".")
    parent, _, child = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, child)
    new = QLinear(parts, None if isinstance(old, nn.Embedding) else old.bias, kernel)
    new.int8, new.split, new.mixed = acts != "float32", acts == "int16", acts == "mixed"
    if new.int8 and kernel is not None:
        new.pack()
    setattr(owner, child, QEmbedding(new) if isinstance(old, nn.Embedding) else new)
