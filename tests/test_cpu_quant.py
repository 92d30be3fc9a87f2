"""The block kernels (kernels/cpu_quant.cpp) against gguf-py's own dequantization followed by a float matmul, per
block type and per ISA build: dequantized rows equal gguf.quants.dequantize, and the GEMV (a decode step's rows,
with its fused norm, activation, bias and residual) equals the float product within fp32 rounding."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_build, cpu_quant
from engine.models.quant import Blocks, QLinear, prefill_dtype

gguf = pytest.importorskip("gguf")
TARGETS = [t for t in ("avx2", "avx512") if t == "avx2" or cpu_build.isa() == "avx512"]


def kernel(target: str) -> cpu_quant.CpuQuant:
    lib = cpu_build.library(target)
    if lib is None:
        pytest.skip("no CPU kernels here (not x86 with AVX2, or no compiler)")
    return cpu_quant.CpuQuant(lib)


def blocks(kind: str, rows: int, k: int, seed: int) -> Blocks:
    """`rows` x `k` random weights in `kind`: quantized by gguf-py where it can, else random block bytes with
    finite scales (gguf-py has no K-quant quantizer)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        raw = w.view(np.uint8)
    elif kind == "F16":
        raw = w.astype(np.float16).view(np.uint8)
    elif kind in ("BF16", "Q8_0", "Q4_0", "Q5_0"):
        raw = gguf.quantize(w, qt)
    else:
        size, nbytes = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, (rows, k // size, nbytes), dtype=np.uint8)
        scales = rng.uniform(0.001, 0.05, (rows, k // size, 2)).astype(np.float16).view(np.uint8)
        if kind == "Q4_K":                        # d and dmin first
            raw[..., 0:4] = scales
        else:                                     # Q6_K: d last
            raw[..., 208:210] = scales[..., 0:2]
        raw = raw.reshape(rows, -1)
    return Blocks(int(qt), torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1)), k)


def dense(b: Blocks) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(b.data.numpy(), gguf.GGMLQuantizationType(b.type)).astype(np.float32)
                            ).reshape(b.rows, b.k)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", list(cpu_quant.TYPES))
@pytest.mark.parametrize("packed", [False, True])
def test_rows_dequantize_as_gguf_does(kind, target, packed):
    """In the file's layout, and packed (two groups of 8 rows and 3 rows after them): any range of rows."""
    b = blocks(kind, 19, 512, seed=1)
    q = QLinear([b], None, kernel(target))
    if packed:
        q.pack()
        assert q.kinds[0][4] == (not kind.startswith(("F", "BF")))
    assert torch.equal(q.kernel.dequant(q.mat(), 0, 19, 512), dense(b))
    assert torch.equal(q.kernel.dequant(q.mat(), 3, 15, 512), dense(b)[3:18])
    ids = torch.tensor([[18, 0], [3, 3]])
    assert torch.equal(q.rows(ids), dense(b)[ids])


def int8(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: per 32 values, round(x * 127 / max|x|) * max|x| / 127 (to nearest even)."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    # as the kernel rounds: x times 127 / max|x| (fp32), not x / d, which differs in the last bit at ties
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127)).reshape(x.shape)


def second(x: torch.Tensor, first: torch.Tensor, over: float) -> torch.Tensor:
    """The second digit as the kernel rounds it: int8 of what the first left, in the blocks whose scale is over
    `over` times the row's median block's (the upper median, as nth_element picks it; 0: every block)."""
    m, k = x.shape
    scale = x.reshape(m, -1, 32).abs().amax(-1) / 127
    bar = over * scale.sort(-1).values[:, k // 64 : k // 64 + 1] if over > 0 else torch.full((m, 1), -1.0)
    rest = (x - first).reshape(m, -1, 32) * (scale > bar).unsqueeze(-1)
    return int8(rest.reshape(m, k))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", list(cpu_quant.TYPES))
@pytest.mark.parametrize("m", [1, 3, 8, 13])
@pytest.mark.parametrize("acts", ["float32", "int8", "int8 packed", "mixed", "mixed packed", "int16 packed"])
def test_the_gemv_is_the_float_product_of_the_dequantized_blocks(kind, m, target, acts):
    """float32: with x itself; int8: with x rounded per 32 values (the float types always take x itself), from the
    file's layout or from rows packed in groups of 8 (45 rows: 5 groups, two pairs of them in 512-bit vectors from 4
    input rows where AVX512-VNNI builds, and 5 rows in the file's layout; 13 input rows: more than one tile of them);
    int16: the products of x's rounding and of its remainder's, summed; mixed: the remainder's only in the blocks
    whose scale is over 3x the row's median (x has a few such, as real models' activations do)."""
    b = blocks(kind, 45, 512, seed=2)
    bias = torch.randn(45)
    q = QLinear([b], bias, kernel(target))
    q.int8, q.split, q.mixed = acts != "float32", acts.startswith("int16"), acts.startswith("mixed")
    if acts.endswith("packed"):
        q.pack()
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    x[:, 64:96] *= 8                          # outlier blocks: 2 and, for the first row, 9
    x[0, 288:320] *= 5
    seen = [int8(x) if q.int8 and not kind.startswith(("F", "BF")) else x]
    if (q.split or q.mixed) and seen[0] is not x:
        seen.append(second(x, seen[0], 0.0 if q.split else 3.0))
        assert q.split or 0 < int((seen[1] != 0).reshape(m, -1, 32).any(-1).sum()) < m * 16 // 4
    w = dense(b).double()
    want = sum(s.double() for s in seen) @ w.T + bias.double()
    # within fp32 summation's bound: k ulps of the sum of |terms| (any order of summation meets it)
    bound = 512 * 2.0 ** -24 * (sum(s.double().abs() for s in seen) @ w.abs().T + bias.double().abs())
    got = q.forward(x).double()
    assert ((got - want).abs() <= bound).all()
    if q.split and len(seen) == 2:  # two digits: within 2^-14 of the sum of |terms| of the float product
        assert ((got - (x.double() @ w.T + bias.double())).abs() <= 2.0 ** -14 * (x.double().abs() @ w.abs().T)).all()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("acts", ["int8", "mixed", "int16"])
def test_a_row_is_the_same_to_the_bit_whatever_rows_share_its_pass(kind, target, acts):
    """Speculation's verify rows and a batch's rows take other passes than a row alone (from cpu_build.pair_rows()
    rows, two groups a pass in 512-bit vectors where VNNI builds): each row's product must equal, to the bit, the
    one it gets alone, or greedy tokens would depend on what else the step holds."""
    q = QLinear([blocks(kind, 45, 512, seed=3)], None, kernel(target))
    q.split, q.mixed = acts == "int16", acts == "mixed"
    q.pack()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(7))
    x[:, 64:96] *= 8
    alone = torch.cat([q.forward(x[i:i + 1]) for i in range(9)])
    for m in range(2, 10):
        assert torch.equal(q.forward(x[:m]), alone[:m]), m


def extreme(kind: str, rows: int, k: int) -> Blocks:
    """Every weight at its type's greatest stored integer (Q8_0's +127), scales small and finite: the int8 products'
    largest partial sums, where an int16 sum that overflowed would show."""
    qt = gguf.GGMLQuantizationType[kind]
    size, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = np.full((rows, k // size, nbytes), 0xFF, dtype=np.uint8)
    half = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    if kind == "Q8_0":
        raw[..., 2:] = 127
    at = {"Q4_K": slice(0, 4), "Q6_K": slice(208, 210)}.get(kind, slice(0, 2))
    raw[..., at] = half[: at.stop - at.start]
    return Blocks(int(qt), torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1)), k)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_int8_products_hold_their_largest_sums(kind, target, sign):
    """Packed rows' int8 products where every weight is its type's largest and every x rounds to +-127 (AVX2 sums
    runs of small weights' pair products in int16 before widening them: kernels/cpu_packed.h)."""
    b = extreme(kind, 16, 512)
    q = QLinear([b], None, kernel(target))
    q.int8 = True
    q.pack()
    x = torch.full((3, 512), sign)
    w = dense(b).double()
    want = x.double() @ w.T
    assert ((q.forward(x).double() - want).abs() <= 512 * 2.0 ** -24 * (x.double().abs() @ w.abs().T)).all()


@pytest.mark.parametrize("target", TARGETS)
def test_a_fused_projection_of_mixed_types_with_its_norm_activation_and_residual(target):
    parts = [blocks("Q4_K", 12, 256, 3), blocks("Q6_K", 6, 256, 4), blocks("Q8_0", 6, 256, 5)]
    q = QLinear(parts, None, kernel(target))
    q.int8 = False
    w = torch.cat([dense(p) for p in parts])

    class Norm:
        weight, eps, gemma = torch.randn(256), 1e-6, False
    x, res = torch.randn(5, 256), torch.randn(5, 24)
    got = q.fused(x, norm=Norm, residual=res)
    torch.testing.assert_close(got, F.rms_norm(x, (256,), Norm.weight, 1e-6) @ w.T + res, rtol=1e-4, atol=1e-4)
    gate_up = torch.randn(2, 512)
    got = q.fused(gate_up, act="silu")
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(got, (F.silu(gate) * up) @ w.T, rtol=1e-4, atol=1e-4)
    big = torch.randn(40, 256)                    # prefill: dequantized slices through torch's GEMM
    torch.testing.assert_close(q.forward(big), big @ w.T, rtol=1e-4, atol=1e-4)
    q.int8 = True                                 # beside int8 activations: in bf16 where the CPU has it
    q.pack()
    assert [kind[4] for kind in q.kinds] == [1, 1, 1] and q.blocks.numel() > sum(p.data.numel() for p in parts)
    lossy = prefill_dtype() == torch.bfloat16
    assert lossy == bool({"avx512_bf16", "amx_bf16"} & cpu_build.cpu_flags())
    # bf16 rounds each x and w by at most 2^-8 relative: the error is within 2^-7 of the sum of |terms|
    bound = (2.0 ** -7 if lossy else 1e-5) * (big.abs() @ w.abs().T) + 1e-4
    assert ((q.forward(big) - big @ w.T).abs() <= bound).all()
    assert q.shape == (24, 256) and ctypes.addressof(q.mat()) == ctypes.addressof(q.mat())


def int16(x: torch.Tensor) -> torch.Tensor:
    """x as prefill's int16 products see it: per 32 values, round(x * 32767 / max|x|) * max|x| / 32767."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax)))
    return (q * (amax / 32767)).reshape(x.shape)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [40, 88])
@pytest.mark.parametrize("m", [33, 50])
def test_int16_prefill_is_the_float_product_of_x_to_16_bits(kind, rows, m):
    """Prefill (more than BLOCK_ROWS rows) through VNNI's int16 products (cpu_gemm16.h), panels of 32 weight rows
    (40 and 88: a last panel of one group, or of three), 6 input rows at a time (33 and 50: a last tile of 3 and 2):
    x rounded to int16 per 32 values times the dequantized blocks, within fp32 summation's bound. Without VNNI it
    declines, and prefill dequantizes into torch's fp32 GEMM."""
    b = blocks(kind, rows, 512, seed=4)
    bias = torch.randn(rows)
    q = QLinear([b], bias, kernel(TARGETS[-1]))
    q.split = True
    q.pack()
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    x[:, 64:96] *= 8
    got = q.kernel.gemm16(x, q.mat(), rows, 512, q.bias)
    if not {"avx512_vnni"} <= cpu_build.cpu_flags() or "avx512" not in TARGETS:
        assert got is None
        return
    w = dense(b).double()
    seen = int16(x).double()
    want = seen @ w.T + bias.double()
    bound = 512 * 2.0 ** -24 * (seen.abs() @ w.abs().T + bias.double().abs())
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(q.forward(x), got)
    # against x itself: within 2^-15 of the sum of |terms| (x's rounding is half of max|x| / 32767 a value)
    exact = x.double() @ w.T + bias.double()
    assert ((got.double() - exact).abs() <= 2.0 ** -15 * (x.double().abs() @ w.abs().T) + bound).all()


def test_int16_prefill_declines_a_part_of_loose_rows():
    """A part whose rows are not whole groups of 8 (the rows past the last stay in the file's layout) goes to the
    fp32 GEMM of its dequantized blocks."""
    b = blocks("Q8_0", 44, 256, seed=5)
    q = QLinear([b], None, kernel(TARGETS[-1]))
    q.split = True
    q.pack()
    x = torch.randn(40, 256)
    assert q.kernel.gemm16(x, q.mat(), 44, 256, None) is None
    torch.testing.assert_close(q.forward(x), x @ dense(b).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("acts", ["int8", "mixed", "int16"])
def test_prefill_takes_the_int16_products_where_the_cpu_has_vnni(acts):
    """Every integer setting's prefill rows go through VNNI's int16 products where the CPU has AVX512-VNNI, except
    int8 and mixed on a CPU with AMX (torch's bf16 GEMM on its tiles); elsewhere the dequantized slices' GEMM, in
    bf16 beside int8 and mixed where the CPU has bf16 arithmetic, else fp32."""
    from engine.models.quant import prefill16
    q = QLinear([blocks("Q5_0", 64, 256, seed=6)], torch.randn(64), kernel(TARGETS[-1]))
    q.split, q.mixed = acts == "int16", acts == "mixed"
    q.pack()
    x = torch.randn(48, 256)
    flags = cpu_build.cpu_flags()
    assert prefill16(q.split) == ("avx512_vnni" in flags and (q.split or "amx_bf16" not in flags))
    sixteen = q.kernel.gemm16(x, q.mat(), 64, 256, q.bias)
    if prefill16(q.split) and sixteen is not None:
        assert torch.equal(q.forward(x), sixteen)
    else:
        want = q.sliced(x, prefill_dtype() if not q.split else torch.float32)
        assert torch.equal(q.forward(x), want)
