"""GGUF's block formats on a GPU, in Triton: decode's few rows times a weight kept in its blocks (the GPU's
counterpart of cpu_quant's GEMV), and rows of such a weight dequantized (prefill's GEMM slices, an embedding's
lookup).

A projection's weight is QLinear's: one uint8 tensor holding its parts one after another, each part described by
(GGML type, rows, row_bytes) (models/quant.py). A part is one launch. A program owns a tile of rows and walks along
k a chunk at a time; it sees the chunk as sub-blocks of SUB weights (one scale each): the scales are loaded once a
sub-block and the quants once a weight, unpacked with integer ops, and multiplied in fp32. Activations (fp32 or
bf16) are widened to fp32, never rounded to int8, and the products accumulate in fp32.
The layouts are llama.cpp's, as gguf-py's gguf.quants reads them; the weights come out bit for bit as its
`dequantize` computes them (scale products in the same order), up to a GPU's fused multiply-adds.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

# GGML's type ids (as cpu_quant.TYPES) and the weights a scale covers
F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 6, 8, 12, 14, 30
SUB = {F32: 32, F16: 32, BF16: 32, Q8_0: 32, Q4_0: 32, Q5_0: 32, Q4_K: 32, Q6_K: 16}
CHUNK = 256           # weights of a row a program takes per step: one K-quant super-block, eight small blocks
TILE = 4096           # rows x chunk x activation rows a program multiplies at a time (its registers)


@triton.jit
def _byte(data, at, ok):
    return tl.load(data + at, mask=ok, other=0).to(tl.int32)


@triton.jit
def _half(words, at, ok):
    """The fp16 at byte `at` (even: every field of 16 bits or more lies at an even offset), as fp32."""
    return tl.load(words + at // 2, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _weights(data, words, row, first, t, ok, KIND: tl.constexpr):
    """Weights first + t of the rows starting at byte `row` [R, 1, 1], fp32 [R, S, SUB]: `first` [1, S, 1] is each
    sub-block's first weight, t [1, 1, SUB] the weight within it, ok [R, S, 1] the sub-blocks that exist."""
    if KIND == 8:                                     # Q8_0: d (f16), 32 int8
        blk = row + (first // 32) * 34
        q = tl.load(data + blk + 2 + t, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _half(words, blk, ok)
    elif KIND == 2:                                   # Q4_0: d, 16 bytes: weight t < 16 low nibbles, then high; - 8
        blk = row + (first // 32) * 18
        nib = (_byte(data, blk + 2 + t % 16, ok) >> (t // 16 * 4)) & 15
        w = _half(words, blk, ok) * (nib - 8).to(tl.float32)
    elif KIND == 6:                                   # Q5_0: d, 32 bits of fifth bits, nibbles as Q4_0; - 16
        blk = row + (first // 32) * 22
        high = (_byte(data, blk + 2 + t // 8, ok) >> (t % 8)) & 1
        nib = (_byte(data, blk + 6 + t % 16, ok) >> (t // 16 * 4)) & 15
        w = _half(words, blk, ok) * ((nib | (high << 4)) - 16).to(tl.float32)
    elif KIND == 12:
        # Q4_K: 256 weights: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; sub-block s is
        # (d * scale_s) * q - dmin * min_s. Of the 12 bytes, in three fours A, B, C: s < 4 has the low 6 bits of
        # A[s] (scale) and B[s] (min); s >= 4 the low and high nibbles of C[s - 4] under the top 2 bits of A[s - 4]
        # and B[s - 4].
        blk = row + (first // 256) * 144
        s = first % 256 // 32
        a, b, c = _byte(data, blk + 4 + s % 4, ok), _byte(data, blk + 8 + s % 4, ok), _byte(data, blk + 12 + s % 4, ok)
        scale = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
        low = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
        # sub-blocks 2i and 2i + 1: the low and high nibbles of bytes [32i, 32i + 32)
        q = (_byte(data, blk + 16 + 32 * (s // 2) + t, ok) >> (s % 2 * 4)) & 15
        w = (_half(words, blk, ok) * scale) * q.to(tl.float32) - _half(words, blk + 2, ok) * low
    elif KIND == 14:
        # Q6_K: 256 weights: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16), d (f16)
        # last; (d * scale) * (q - 32). Weight i of half h (128 weights) is nibble i // 64 of low byte 64h + i % 64
        # under bits 2 (i // 32) of high byte 32h + i % 32.
        blk = row + (first // 256) * 210
        i = first % 256 + t
        h, i = i // 128, i % 128
        low = (_byte(data, blk + 64 * h + i % 64, ok) >> (i // 64 * 4)) & 15
        high = (_byte(data, blk + 128 + 32 * h + i % 32, ok) >> (i // 32 * 2)) & 3
        scale = tl.load(data + blk + 192 + first % 256 // 16, mask=ok, other=0).to(tl.int8, bitcast=True)
        w = (_half(words, blk + 208, ok) * scale.to(tl.float32)) * ((low | (high << 4)) - 32).to(tl.float32)
    elif KIND == 1:                                   # F16
        w = _half(words, row + 2 * (first + t), ok)
    elif KIND == 30:                                  # BF16: the top half of an fp32
        bits = tl.load(words + (row + 2 * (first + t)) // 2, mask=ok, other=0).to(tl.int32) << 16
        w = bits.to(tl.float32, bitcast=True)
    else:                                             # F32, as two 16-bit words (a part may start 2 bytes off 4)
        at = (row + 4 * (first + t)) // 2
        low = tl.load(words + at, mask=ok, other=0).to(tl.int32) & 0xFFFF
        high = tl.load(words + at + 1, mask=ok, other=0).to(tl.int32)
        w = ((high << 16) | low).to(tl.float32, bitcast=True)
    return w


@triton.jit
def _gemv(x_ptr, data, words, y_ptr, m, n, k, row_bytes, stride_x, stride_y, KIND: tl.constexpr,
          SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = (r.to(tl.int64) * row_bytes)[:, None, None]
    s, t = tl.arange(0, CHUNK // SUB)[None, :, None], tl.arange(0, SUB)[None, None, :]
    i, j = tl.arange(0, BLOCK_M), tl.arange(0, CHUNK)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, CHUNK):
        first = k0 + s * SUB
        w = _weights(data, words, row, first, t, (r < n)[:, None, None] & (first < k), KIND)
        w = tl.reshape(w, [BLOCK_N, CHUNK])
        x = tl.load(x_ptr + i[:, None] * stride_x + k0 + j[None, :], mask=(i < m)[:, None] & (k0 + j < k)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + i[:, None] * stride_y + r[None, :], acc, mask=(i < m)[:, None] & (r < n)[None, :])


@triton.jit
def _take(data, words, ids_ptr, out_ptr, count, k, row_bytes, start, end, KIND: tl.constexpr, SUB: tl.constexpr,
          BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """out[i] = row ids[i] of the weight, for the ids in this part's rows [start, end); the others are left."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * CHUNK
    ids = tl.load(ids_ptr + i, mask=i < count, other=-1).to(tl.int64)
    mine = (i < count) & (ids >= start) & (ids < end)
    row = ((ids - start) * row_bytes)[:, None, None]
    s, t = tl.arange(0, CHUNK // SUB)[None, :, None], tl.arange(0, SUB)[None, None, :]
    first = k0 + s * SUB
    w = tl.reshape(_weights(data, words, row, first, t, mine[:, None, None] & (first < k), KIND), [BLOCK_R, CHUNK])
    j = k0 + tl.arange(0, CHUNK)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * k + j[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mine[:, None] & (j < k)[None, :])


def parts(blocks: torch.Tensor, kinds: list[tuple[int, ...]]) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """Each part as (type, first row, rows, its bytes); `kinds` are QLinear's: (type, rows, row_bytes) and, after
    them, its bytes and whether QLinear.pack interleaved its rows for the CPU (which these kernels cannot read)."""
    offset = first = 0
    for kind, rows, row_bytes, *more in kinds:
        if kind not in SUB:
            raise ValueError(f"triton_quant: no kernel for GGML type {kind}")
        if more and more[-1]:
            raise ValueError("triton_quant: a part packed for the CPU kernels")
        yield kind, first, rows, blocks[offset:offset + rows * row_bytes]
        offset, first = offset + rows * row_bytes, first + rows


def gemv(x: torch.Tensor, blocks: torch.Tensor, kinds: list[tuple[int, ...]],
         shape: tuple[int, int]) -> torch.Tensor:
    """y [m, n] fp32 = x [m, k] (fp32 or bf16; m a few decode rows) times w [n, k] in `blocks`, described by
    `kinds` (QLinear's data)."""
    n, k = shape
    m = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    block_m = triton.next_power_of_2(m)
    chunk = min(CHUNK, triton.next_power_of_2(k))
    block_n = max(2, TILE // (block_m * chunk))
    for kind, first, rows, data in parts(blocks, kinds):
        out = y[:, first:first + rows]
        _gemv[(triton.cdiv(rows, block_n),)](x, data, data.view(torch.int16), out, m, rows, k,
                                             data.numel() // rows, x.stride(0), out.stride(0), KIND=kind,
                                             SUB=SUB[kind], BLOCK_M=block_m, BLOCK_N=block_n, CHUNK=chunk)
    return y


def take(blocks: torch.Tensor, kinds: list[tuple[int, ...]], k: int, ids: torch.Tensor,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (a 1-d tensor on the blocks' device) of w, dequantized to `dtype`: [len(ids), k]."""
    out = torch.empty((ids.shape[0], k), dtype=dtype, device=blocks.device)
    chunk = min(CHUNK, triton.next_power_of_2(k))
    block_r = max(2, TILE // chunk)
    grid = (triton.cdiv(ids.shape[0], block_r), triton.cdiv(k, chunk))
    for kind, first, rows, data in parts(blocks, kinds):
        _take[grid](data, data.view(torch.int16), ids, out, ids.shape[0], k, data.numel() // rows, first,
                    first + rows, KIND=kind, SUB=SUB[kind], BLOCK_R=block_r, CHUNK=chunk)
    return out


def dequant(blocks: torch.Tensor, kinds: list[tuple[int, ...]], k: int, first: int, rows: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows first..first + rows of w, [rows, k] in `dtype` (prefill: a slice at a time before torch's GEMM)."""
    return take(blocks, kinds, k, torch.arange(first, first + rows, device=blocks.device), dtype)
