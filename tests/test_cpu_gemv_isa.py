"""The decode GEMV (cpu_gemv.cpp) in each build this CPU can run: AVX2, AVX-512, and AVX-512 with BF16's vdpbf16ps
for bf16 weights. Each is held to torch's fp32 result, x @ w.T + b computed in fp32 from the same fp32 or bf16
values, within a stated bound."""
from __future__ import annotations

import ctypes

import pytest
import torch

from engine.kernels import cpu_build, cpu_gemv
from engine.models.decoder import RMSNorm

NEEDS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
BUILDS = [("avx2", []), ("avx512", []), ("avx512", ["bf16"])]


def runnable(target: str, exts: list[str]) -> bool:
    return NEEDS[target] <= cpu_build.cpu_flags() and all(f"avx512_{e}" in cpu_build.cpu_flags() for e in exts)


@pytest.fixture(scope="module", params=BUILDS, ids=lambda b: "+".join([b[0], *b[1]]))
def lib(request) -> ctypes.CDLL:
    target, exts = request.param
    if not runnable(target, exts):
        pytest.skip(f"this CPU cannot run the {target} {exts} build")
    try:
        return ctypes.CDLL(str(cpu_build.build(target, exts)))
    except RuntimeError as e:
        pytest.skip(f"no build: {e}")


@pytest.fixture(scope="module")
def gemv(lib) -> cpu_gemv.CpuGemv:
    return cpu_gemv.CpuGemv(lib, threads=2)


def within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, input_ulps: int = 0) -> None:
    """got == x @ w.T + b in fp32, up to the fp32 sums' rounding (1e-5 of sum |x w|, far above k * 2**-24 for these
    k), for bf16 the output's one rounding to bf16 (half an ulp: at most 2**-8 relative), and where the
    kernel made x itself, `input_ulps` ulps of each input value (2**-7 relative in bf16, 2**-23 in fp32)."""
    xf, wf = x.float(), w.float()
    want = xf @ wf.T + (0 if b is None else b.float())
    magnitude = xf.abs() @ wf.abs().T
    ulp = 2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -23
    bound = 1e-5 * (magnitude + (0 if b is None else b.float().abs())) + 1e-30 + input_ulps * ulp * magnitude
    if got.dtype == torch.bfloat16:
        bound = bound + 2 ** -8 * want.abs()
    err = (got.float() - want).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max():.2f}x the bound"


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n,k", [(1152, 896), (37, 84), (7, 40), (3, 13), (130, 4864)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_the_fp32_product(gemv, m, n, k, bias, dtype):
    """Shapes with k a multiple of every step (896, 4864) and with tails (84, 40, 13); odd n (the rows left over
    from pairs); m past the 4 input rows a block."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = gemv(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    within(got, x, w, b)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_inputs_match_the_fp32_product(gemv, m, dtype):
    """The fused call's inputs (RMSNorm, SwiGLU; residual added after) through each build's dot product: the
    product of the input as torch's modules compute it, within the same bound plus one bf16 ulp of each input (the
    kernel's norm and SwiGLU are within one of torch's: tests/test_cpu_kernels.py)."""
    g = torch.Generator().manual_seed(m)
    k, n = 896, 300
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    norm = RMSNorm(k, 1e-6).to(dtype)
    norm.weight.data = torch.randn(k, generator=g).to(dtype)
    with torch.no_grad():
        normed = norm.forward(x)
    within(gemv.fused(x, w, norm=norm), normed, w, None, input_ulps=1)
    gate_up = torch.randn(m, 2 * k, generator=g).to(dtype)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    within(gemv.fused(gate_up, w, act="silu"), act, w, None, input_ulps=1)
    res = torch.randn(m, n, generator=g).to(dtype)
    torch.testing.assert_close(gemv.fused(x, w, residual=res), (gemv(x, w).float() + res.float()).to(dtype),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_and_multi_thread_agree_to_the_bit(lib, gemv, dtype):
    x, w = torch.randn(8, 896).to(dtype), torch.randn(1000, 896).to(dtype)
    one = cpu_gemv.CpuGemv(lib, threads=1)
    for m in (1, 3, 8):
        torch.testing.assert_close(one(x[:m], w), gemv(x[:m], w), rtol=0, atol=0)


def test_this_cpu_builds_with_the_extensions_it_has():
    exts = cpu_build.extensions("avx512")
    assert ("bf16" in exts) == ("avx512_bf16" in cpu_build.cpu_flags())
    assert cpu_build.extensions("avx2") == []
    assert cpu_build.described("avx2") == "avx2"


def test_the_build_flags_follow_the_cpu(monkeypatch):
    """Weight streams prefetched ahead on Intel CPUs only; the VNNI GEMV's 512-bit pairs from 5 rows on a Zen 4
    (AMD family 25), from 4 elsewhere; both flags in the library's key."""
    cpus = {("GenuineIntel", "6"): (4096, 4), ("AuthenticAMD", "25"): (0, 5), ("AuthenticAMD", "26"): (0, 4),
            ("", ""): (0, 4)}
    for (vendor, family), (ahead, rows) in cpus.items():
        info = {"vendor_id": vendor, "cpu family": family}
        monkeypatch.setattr(cpu_build, "cpu_info", lambda field, i=info: i.get(field, ""))
        assert cpu_build.ahead() == ahead and cpu_build.pair_rows() == rows
        flags = cpu_build.compile_flags("avx2")
        assert f"-DPAGODA_AHEAD={ahead}" in flags and f"-DPAGODA_PAIR_ROWS={rows}" in flags
