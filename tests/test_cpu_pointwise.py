"""The CPU pointwise kernels of a decode step (RMSNorm, SwiGLU and GeGLU through the fused GEMV's input, RoPE,
greedy argmax): torch's result, at the exponent clamps and past them (bf16: within one bf16 ulp)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_pointwise
from engine.models.config import RopeSpec
from engine.models.decoder import RMSNorm, Rope
from tests.helpers import ULP


def silu_mul(gemv, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The fused GEMV's SwiGLU (GeGLU) alone: against an identity weight, every output is one product plus zeros
    (exact)."""
    n = gate_up.shape[1] // 2
    return gemv.fused(gate_up, torch.eye(n, dtype=gate_up.dtype), act=act)


@pytest.mark.parametrize("m,n", [(1, 896), (3, 84), (8, 13)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_match_torch(gemv, m, n, dtype):
    pw = cpu_pointwise.load()
    x, gu = torch.randn(m, n).to(dtype), (torch.randn(m, 2 * n) * 4).to(dtype)
    norm = RMSNorm(n, 1e-6).to(dtype)
    norm.weight.data = torch.randn(n).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else ULP
    with torch.no_grad():
        torch.testing.assert_close(pw.rms_norm(x, norm.weight, 1e-6), norm.forward(x), **tol)
    torch.testing.assert_close(silu_mul(gemv, gu), F.silu(gu[:, :n]) * gu[:, n:], **tol)


def test_silu_mul_holds_at_the_exponent_clamp_and_past_it(gemv):
    g = torch.tensor([-100.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 3.0, 20.0, 87.0, 88.0, 100.0, 5.0, -5.0, 0.5, 9.0])
    gu = torch.cat([g, torch.linspace(-2, 2, 16)])[None]
    want = F.silu(g) * gu[0, 16:]
    torch.testing.assert_close(silu_mul(gemv, gu)[0], want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mul_matches_torch_across_the_range_and_past_the_exponent_clamp(gemv, dtype):
    """GeGLU's vectors (0.5 (1 + tanh y) as a logistic of 2y) and its scalar tail (the last 3 of 35) against torch's
    tanh-approximated GELU, at the values where e^(-2y) clamps and between."""
    g = torch.cat([torch.tensor([-60.0, -10.0, -4.0, -1e-3, 0.0, 1e-3, 4.0, 10.0, 60.0]), torch.linspace(-6, 6, 26)])
    gu = torch.cat([g, torch.linspace(-2, 2, 35)])[None].to(dtype)
    want = F.gelu(gu[:, :35], approximate="tanh") * gu[:, 35:]
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else ULP
    torch.testing.assert_close(silu_mul(gemv, gu, "gelu_pytorch_tanh"), want, **tol)


@pytest.mark.parametrize("m,n", [(1, 262144), (3, 1000), (2, 13), (4, 33)])
def test_argmax_is_torchs_first_of_equals_and_first_nan(gemv, m, n):
    from engine.runners.torch.sampler import argmax
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(argmax(x), x.argmax(-1))
    x[:, n // 3] = x[:, n - 1] = x.max() + 1                # ties: the first
    if m > 1:
        x[1, n // 2:] = float("nan")                        # NaN wins, the first of them
    x[-1] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(-1))


@pytest.mark.parametrize("t,heads,rotated,hd", [(1, 18, 16, 64), (3, 4, 3, 128), (2, 9, 8, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_the_given_heads_in_place_as_rope_apply(gemv, t, heads, rotated, hd, dtype):
    rope = Rope(hd, RopeSpec(1e6))
    cos, signed_sin = rope.tables(torch.tensor([0, 77, 255][:t]), dtype)
    x = torch.randn(t, heads, hd).to(dtype)
    got = x.clone()
    cpu_pointwise.load().rope(got, cos, signed_sin, heads=rotated)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else ULP
    torch.testing.assert_close(got[:, :rotated], Rope.apply(x[:, :rotated], cos, signed_sin), **tol)
    assert torch.equal(got[:, rotated:], x[:, rotated:])           # v heads untouched
