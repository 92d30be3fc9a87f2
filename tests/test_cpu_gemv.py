"""The CPU decode GEMV: F.linear's result for every shape decode gives it, the engine routing its projections there,
and torch serving whenever the kernel is off, unfit or cannot be built."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.kernels import cpu_gemv
from engine.models.presets import make_model
from engine.models.qwen2 import Linear
from tests.conftest import random_ids



@pytest.fixture(scope="module")
def gemv() -> cpu_gemv.CpuGemv:
    kernel = cpu_gemv.load(threads=2)
    if kernel is None:
        pytest.skip("no x86 AVX2+FMA CPU or no C++ compiler: torch serves (the other tests here cover that)")
    return kernel


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> str:
    return str(make_model("small", tmp_path_factory.mktemp("small"), seed=0))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n,k", [(1152, 896), (37, 84), (6, 8), (1, 13), (4099, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear(gemv, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gemv(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_single_and_multi_thread_agree_and_strided_input_is_made_contiguous(gemv):
    x, w = torch.randn(16, 512)[::2], torch.randn(640, 512)      # every other row: a strided [8, 512]
    one = cpu_gemv.load(threads=1)
    torch.testing.assert_close(one(x, w), gemv(x, w), rtol=0, atol=0)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_one_openmp_runtime_in_the_process(gemv):
    maps = Path("/proc/self/maps").read_text()
    assert len({line.split()[-1] for line in maps.splitlines() if "libgomp" in line}) == 1


def test_engine_routes_decode_projections_to_the_kernel_and_generates_what_torch_does(gemv, small_dir, monkeypatch):
    calls = []
    real = cpu_gemv.CpuGemv.__call__
    monkeypatch.setattr(cpu_gemv.CpuGemv, "__call__", lambda self, x, w, b=None: calls.append(x.shape[0])
                        or real(self, x, w, b))
    prompts = [random_ids(40, seed=1), random_ids(9, seed=2)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fast = LLM(model=small_dir, dtype="float32", max_batch_size=2)
    model = fast.engine.runner.model
    assert all(mod.gemv is fast.engine.runner.gemv for mod in model.modules() if isinstance(mod, Linear))
    got = [o.token_ids for o in fast.generate(prompts, params)]
    layers = len(model.layers)
    assert calls and max(calls) <= cpu_gemv.MAX_ROWS
    assert len(calls) >= 23 * (4 * layers + 1)           # every projection and the head of every decode step
    monkeypatch.setenv("PAGODA_CPU_GEMV", "0")
    plain = LLM(model=small_dir, dtype="float32", max_batch_size=2)
    assert plain.engine.runner.gemv is None
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    assert fast.engine.pool.num_used == 0


def test_torch_serves_small_weights_bf16_and_compiled_decode(tiny_dir, small_dir):
    tiny = LLM(model=tiny_dir, dtype="float32").engine.runner
    if tiny.gemv is not None:
        assert all(mod.gemv is None for mod in tiny.model.layers.modules() if isinstance(mod, Linear))  # too small
        assert tiny.model.head_gemv is tiny.gemv                                                 # [1024, 64]
    assert LLM(model=small_dir, dtype="bfloat16").engine.runner.gemv is None
    compiled = LLM(model=small_dir, dtype="float32", compile=True).engine.runner
    assert compiled.gemv is None and compiled.model.head_gemv is None


def test_a_failed_build_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch, caplog):
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("not an AVX2 CPU: load() returns None before building")
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        assert cpu_gemv.load(threads=1) is None
    assert "no C++ compiler (no-such-compiler)" in caplog.text


def test_kill_switch(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_GEMV", "off")
    assert cpu_gemv.load(threads=1) is None
