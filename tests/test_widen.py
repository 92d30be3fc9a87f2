"""Prefill's bf16 GEMMs in fp32 where the CPU lacks bf16 arithmetic (engine/models/widen.py): the same product as
torch's bf16 F.linear, a slice of the weight at a time, and the runner routes every float projection and the
logits there on such CPUs only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.kernels import cpu_build
from engine.models import decoder, widen
from tests.helpers import ULP, greedy, random_ids


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_widened_product_is_bf16_linear_up_to_rounding(monkeypatch, shape, bias):
    monkeypatch.setattr(widen, "SLICE_BYTES", 4 * 64 * 24)         # slices of 24 rows: 100 = 4 x 24 + 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).bfloat16()
    w = torch.randn(100, 64, generator=g).bfloat16()
    b = torch.randn(100, generator=g).bfloat16() if bias else None
    out = widen.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 100)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), exact.bfloat16().double(), **ULP)
    torch.testing.assert_close(out, F.linear(x, w, b), **ULP)


@pytest.mark.parametrize(("flags", "dtype", "device", "want"), [
    ({"avx2"}, torch.bfloat16, "cpu", True),
    ({"avx2", "avx512_bf16"}, torch.bfloat16, "cpu", False),
    ({"avx2", "amx_bf16"}, torch.bfloat16, "cpu", False),
    ({"avx2"}, torch.float32, "cpu", False),
    ({"avx2"}, torch.bfloat16, "meta", False),
])
def test_only_bf16_on_a_cpu_without_bf16_arithmetic_widens(monkeypatch, flags, dtype, device, want):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(flags))
    assert widen.wanted(dtype, torch.device(device)) is want


def test_the_runner_widens_every_projection_and_the_logits_where_the_cpu_lacks_bf16(monkeypatch, tiny_dir):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    llm = LLM(model=tiny_dir, dtype="bfloat16")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, decoder.Linear)]
    assert model.wide is widen.linear and linears and all(m.wide is widen.linear for m in linears)
    calls = []

    def counted(x, w, bias=None):
        calls.append(tuple(w.shape))
        return widen.linear(x, w, bias)
    ids = random_ids(40, seed=3)
    model.use_wide(counted)
    wide = llm.generate([ids], greedy(6, prompt_logprobs=0))[0]
    assert {tuple(m.weight.shape) for m in linears} <= set(calls)
    assert tuple(model.head_weight.shape) in calls                    # prompt logprobs: every position's logits
    model.use_wide(None)
    plain = llm.generate([ids], greedy(6, prompt_logprobs=0))[0]
    assert wide.token_ids == plain.token_ids
    native = LLM(model=tiny_dir, dtype="float32").engine.runner.model
    assert native.wide is None
