"""A GGUF file's weights for the MLX decoder: the block formats that are MLX's affine quantization exactly stay
quantized and multiply through mx.quantized_matmul; the others are dequantized to float at load.

MLX's affine mode keeps w = scale * q + bias per group of 32 weights, q unsigned in `bits` bits, packed as a
little-endian bit stream (weight i in bits i*bits to (i+1)*bits - 1) viewed as uint32. Four of llama.cpp's formats
are that with groups of 32:
    Q8_0  w = d * q, q int8               8 bits: q + 128, scale d, bias -128 d
    Q4_0  w = d * (q - 8)                 4 bits: scale d, bias -8 d
    Q5_0  w = d * (q - 16)                5 bits: scale d, bias -16 d
    Q4_K  w = d sc * q - dmin m           4 bits: per 32-weight sub-block, scale d sc, bias -dmin m
Q6_K's sub-blocks are 16 weights, a group size MLX lacks: it is dequantized, as are the other types.

In fp32, scales and biases are exact (an fp16 times an integer of at most 8 bits) and so is scale * q; adding the
bias rounds once, as gguf-py's d * q - dmin m does, so mx.dequantize gives gguf-py's fp32 weights bit for bit. On a
GPU they are kept in the model dtype, as mlx-lm keeps them: each rounds there (unit roundoff 2^-8 in bf16, 2^-11 in
fp16), so a weight they stand for is off by at most that much of |scale q| + |bias|, which for Q8_0, Q4_0 and Q5_0
(a bias of a power of two times the scale) is that much of the weight itself. On the CPU they stay fp32 whatever the
model dtype, and the product is cast back to it: MLX's CPU kernel computes in the scales' type, and in bf16 it ran 10x
slower and off by 5-10% of the largest output (Q8_0's q + 128 cancels against its bias) where fp32 is as close as a
dense bf16 product.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from engine.models import gguf_file
from engine.models.config import ModelConfig
from engine.models.quant import Blocks

GROUP = 32
CHUNK = 1 << 22           # weights converted at a time (bounds the numpy temporaries)


class Quantized(NamedTuple):
    """A weight [out, in] as mx.quantized_matmul takes it (transposed), groups of 32 along `in`."""
    w: mx.array           # uint32 [out, in * bits / 32]
    scales: mx.array      # [out, in / 32]
    biases: mx.array

    @property
    def bits(self) -> int:
        return self.w.shape[-1] // self.scales.shape[-1]


# a projection: one float operand [in, out], one Quantized, or parts of both kinds whose outputs are concatenated
Weight = mx.array | Quantized | list[mx.array | Quantized]


def matmul(x: mx.array, w: Weight, bias: mx.array | None = None) -> mx.array:
    if isinstance(w, list):
        out = mx.concatenate([matmul(x, p) for p in w], axis=-1)
    elif isinstance(w, Quantized):
        out = mx.quantized_matmul(x, *w, transpose=True, group_size=GROUP, bits=w.bits).astype(x.dtype)
    else:
        return x @ w if bias is None else mx.addmm(bias, x, w)
    return out if bias is None else out + bias


def rows(table: mx.array | Quantized, ids: mx.array, dtype: mx.Dtype) -> mx.array:
    """An embedding's rows `ids`; a quantized table dequantizes only those."""
    if isinstance(table, Quantized):
        return mx.dequantize(*(a[ids] for a in table), group_size=GROUP, bits=table.bits).astype(dtype)
    return table[ids]


def fuse(parts: list[mx.array | Quantized], operand: Callable[[mx.array], mx.array]) -> Weight:
    """Parts stacked by output rows (q, k, v; gate, up) as one projection: adjacent float parts concatenated into one
    operand, adjacent quantized ones of equal bits into one Quantized; where kinds mix, a list of those."""
    groups: list[list] = []
    for p in parts:
        if groups and _kind(groups[-1][0]) == _kind(p):
            groups[-1].append(p)
        else:
            groups.append([p])
    join = lambda arrays: arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)   # noqa: E731
    out = [operand(join(g)) if isinstance(g[0], mx.array) else Quantized(*map(join, zip(*g))) for g in groups]
    return out[0] if len(out) == 1 else out


def _kind(p: mx.array | Quantized) -> int:
    return p.bits if isinstance(p, Quantized) else 0


def tensors(path: str | Path, cfg: ModelConfig, dtype: mx.Dtype) -> Iterator[tuple[str, mx.array | Quantized]]:
    """The file's tensors under their Hugging Face names: Quantized where the block type converts, else `dtype`."""
    from gguf import GGMLQuantizationType, dequantize
    scales = mx.float32 if mx.default_device() == mx.cpu else dtype
    for name, t in gguf_file.tensors(path, cfg, keep=True):
        if isinstance(t, Blocks):
            if (q := convert(t, scales)) is not None:
                yield name, q
                continue
            array = dequantize(t.data.numpy(), GGMLQuantizationType(t.type)).reshape(t.rows, t.k)
        else:
            array = t.numpy()
        yield name, mx.array(array).astype(dtype)
    gguf_file.close()


def convert(b: Blocks, dtype: mx.Dtype) -> Quantized | None:
    """`b` as MLX's (w, scales, biases) with scales and biases in `dtype`, or None where its type is not one."""
    if b.type not in _UNPACK:
        return None
    unpack, bits, size = _UNPACK[b.type]
    data, step = b.data.numpy(), max(1, CHUNK // b.k)
    parts = []
    for first in range(0, b.rows, step):
        chunk = data[first:first + step]
        n = len(chunk)
        q, scale, bias = unpack(chunk.reshape(n, b.k // size, -1))
        parts.append((pack(q.reshape(n, -1), bits), scale.reshape(n, -1), bias.reshape(n, -1)))
    w, scale, bias = (np.concatenate(a) for a in zip(*parts))
    return Quantized(mx.array(w), mx.array(scale).astype(dtype), mx.array(bias).astype(dtype))


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """q (uint8 [rows, k], values below 2^bits) as MLX's uint32 bit stream: each 8 values fill `bits` bytes."""
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    words = (q.reshape(q.shape[0], -1, 8).astype(np.uint64) << (np.arange(8, dtype=np.uint64) * np.uint64(bits)))
    packed = np.bitwise_or.reduce(words, axis=-1).view(np.uint8).reshape(q.shape[0], -1, 8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(q.shape[0], -1).view(np.uint32)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (the last axis) as the fp16 they hold, in fp32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes of 4-bit values: low nibbles are weights 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


# Each takes blocks [rows, blocks, bytes] and returns q (uint8, unsigned) and fp32 scales and biases, one a group.
def _q8_0(b: np.ndarray):
    d = _f16(b[..., :2])
    return b[..., 2:] ^ np.uint8(0x80), d, -128 * d          # int8 q as uint8, plus 128


def _q4_0(b: np.ndarray):
    d = _f16(b[..., :2])
    return _nibbles(b[..., 2:]), d, -8 * d


def _q5_0(b: np.ndarray):
    d = _f16(b[..., :2])
    high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")       # bit i: weight i's fifth bit
    return _nibbles(b[..., 6:]) | high << 4, d, -16 * d


def _q4_k(b: np.ndarray):
    """256 weights: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, then 4 runs of 32 bytes whose low
    nibbles are one sub-block and high nibbles the next."""
    d, dmin, s = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None], b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], axis=-1)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=-2), d * sc, -(dmin * m)


# by GGML type id: (unpack, bits, weights a block)
_UNPACK = {8: (_q8_0, 8, 32), 2: (_q4_0, 4, 32), 6: (_q5_0, 5, 32), 12: (_q4_k, 4, 256)}
