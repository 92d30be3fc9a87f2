"""The CPU decode kernels (GEMV and what it folds in, paged decode attention, the one-call stack), fp32 and bf16:
torch's result for every shape decode gives them (bf16: rounded where torch rounds, so within one bf16 ulp), the
engine routing decode there, and torch serving whenever they are off, unfit or cannot be built. The pointwise
kernels alone: test_cpu_pointwise.py."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.kernels import CALLS, cpu_attention, cpu_gemv, cpu_layers, cpu_pointwise, reference, select
from engine.models.decoder import Linear, RMSNorm
from engine.models.presets import make_model
from tests.helpers import ULP, random_ids, stacked


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> str:
    return str(make_model("small", tmp_path_factory.mktemp("small"), seed=0))


@pytest.fixture(scope="module", params=["small", "tiny-gemma3", "tiny-qwen3", "tiny-llama"])
def family_dir(request, tmp_path_factory, small_dir) -> str:
    """Qwen2 (small), and the families whose layers differ from it: Gemma 3's norms, GeGLU, two RoPEs and sliding
    windows; Qwen3's q/k norms; Llama's missing biases."""
    if request.param == "small":
        return small_dir
    return str(make_model(request.param, tmp_path_factory.mktemp(request.param), seed=0))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n,k", [(1152, 896), (37, 84), (6, 8), (1, 13), (4099, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_f_linear(gemv, m, n, k, bias, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = gemv(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    else:       # both accumulate in fp32 and round once: at most one bf16 ulp apart (2**-7 relative)
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2 ** -7, atol=1e-3)


def test_single_and_multi_thread_agree_and_strided_input_is_made_contiguous(gemv):
    x, w = torch.randn(16, 512)[::2], torch.randn(640, 512)      # every other row: a strided [8, 512]
    one = cpu_gemv.load(threads=1)
    torch.testing.assert_close(one(x, w), gemv(x, w), rtol=0, atol=0)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_one_openmp_runtime_in_the_process(gemv):
    maps = Path("/proc/self/maps").read_text()
    assert len({line.split()[-1] for line in maps.splitlines() if "libgomp" in line}) == 1


@pytest.mark.parametrize("b,nh,n_kv,hd,bs,lens", [(1, 14, 2, 64, 32, [77]), (3, 7, 1, 12, 8, [37, 1, 40]),
                                                  (4, 4, 4, 16, 16, [5, 16, 17, 64]),
                                                  (4, 4, 2, 64, 32, [1, 32, 33, 200]), (2, 4, 2, 128, 16, [9, 70]),
                                                  (2, 2, 1, 8, 4, [3, 13])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 6, 33])
def test_paged_decode_attention_matches_the_reference(gemv, b, nh, n_kv, hd, bs, lens, dtype, window):
    """Full attention, and sliding windows (one inside a block, one across blocks; some rows shorter than both)."""
    g = torch.Generator().manual_seed(b)
    k_cache, v_cache = torch.randn(2, 24, bs, n_kv, hd, generator=g).to(dtype)
    width = -(-max(lens) // bs)
    tables = torch.stack([torch.randperm(24, generator=g)[:width] for _ in range(b)])
    seq_lens = torch.tensor(lens)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((b, nh, hd), (b, n_kv, hd), (b, n_kv, hd)))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, want_v, slots, k, v)
    want = reference.paged_decode_attention(q.float(), want_k.float(), want_v.float(), tables, seq_lens, 0.3,
                                            window=window)
    got = cpu_attention.load(threads=2)(q, k, v, k_cache, v_cache, slots, tables, seq_lens, 0.3, window)
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else ULP
    torch.testing.assert_close(got.float(), want, **tol)   # bf16: attention in fp32, rounded once
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)       # new K/V written at their slots


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemv_folds_in_norm_swiglu_and_residual(gemv, m, dtype):
    """bf16 against the model's own torch ops, which round after each op: the same roundings, so one ulp at most."""
    g = torch.Generator().manual_seed(m)
    x, w, b, res = (torch.randn(*s, generator=g).to(dtype) for s in ((m, 96), (1152, 96), (1152,), (m, 1152)))
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(gemv.fused(x, w, b, norm=norm), F.linear(norm.forward(x), w, b), **tol)
        gu, down = (torch.randn(m, 2 * 200, generator=g) * 3).to(dtype), torch.randn(96, 200, generator=g).to(dtype)
        want = F.linear(F.silu(gu[:, :200]) * gu[:, 200:], down) + x
        torch.testing.assert_close(gemv.fused(gu, down, act="silu", residual=x), want, **tol)
        torch.testing.assert_close(gemv.fused(x, w, residual=res), F.linear(x, w) + res, **tol)


def test_attention_choice(monkeypatch):
    assert select("auto", "cpu", "float16").name == "reference"
    with pytest.raises(ValueError, match="attention: cpu needs float32 or bfloat16 on a CPU, got float16 on cpu"):
        select("cpu", "cpu", "float16")
    if cpu_build_ok():
        assert select("auto", "cpu", "float32").name == "cpu" and select("auto", "cpu", "bfloat16").name == "cpu"
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    assert select("auto", "cpu", "float32").name == "reference"
    with pytest.raises(ValueError, match="attention: cpu kernels are off or cannot be built here"):
        select("cpu", "cpu", "float32")


def cpu_build_ok() -> bool:
    return cpu_gemv.load(threads=1) is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_engine_routes_decode_to_the_kernels_and_generates_what_torch_does(gemv, family_dir, monkeypatch, dtype,
                                                                           storage):
    """Decode runs every layer in one cpu_layers call, over paged KV or dense (a buffer a row), and decodes what
    torch's ops decode."""
    calls, fused, stacks = [], [], []
    real, real_fused, real_stack = cpu_gemv.CpuGemv.__call__, cpu_gemv.CpuGemv.fused, cpu_layers.CpuLayers.__call__
    monkeypatch.setattr(cpu_gemv.CpuGemv, "__call__", lambda self, x, w, b=None: calls.append(x.shape[0])
                        or real(self, x, w, b))
    monkeypatch.setattr(cpu_gemv.CpuGemv, "fused", lambda self, x, *a, **kw: fused.append(x.shape[0])
                        or real_fused(self, x, *a, **kw))
    monkeypatch.setattr(cpu_layers.CpuLayers, "__call__", lambda self, x, *a: stacks.append(x.shape[0])
                        or real_stack(self, x, *a))
    prompts = [random_ids(40, seed=1), random_ids(9, seed=2)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fast = LLM(model=family_dir, dtype=dtype, max_batch_size=2, kv_storage=storage)
    model = fast.engine.runner.model
    assert all(mod.gemv is fast.engine.runner.gemv for mod in model.modules()
               if isinstance(mod, Linear) and cpu_gemv.CpuGemv.fits(mod.weight))
    before = CALLS["cpu"]
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert fast.engine.runner.ops.name == "cpu" and model.stack is not None
    assert all(layer.kernels == (fast.engine.runner.gemv, model.norm.pointwise) for layer in model.layers)
    assert calls and max(calls + fused + stacks) <= cpu_gemv.MAX_ROWS and len(calls) >= 23   # the head of each step
    assert len(stacks) >= 23 and not fused                                   # every decode step, all layers at once
    assert CALLS["cpu"] > before or storage == "dense"
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    plain = LLM(model=family_dir, dtype=dtype, max_batch_size=2, kv_storage=storage)
    assert plain.engine.runner.gemv is None and plain.engine.runner.ops.name == "reference"
    want = [o.token_ids for o in plain.generate(prompts, params)]
    if dtype == "bfloat16" and "gemma" in family_dir:
        # Gemma's GELU takes tanhf, not torch's vectorised tanh, and its norm's fp32 sum runs in another order: an
        # ulp apart in fp32, now and then a bf16 rounding apart, so greedy paths part after a while (fp32 is exact)
        assert [g[:8] for g in got] == [w[:8] for w in want]
    else:
        assert got == want
    assert fast.engine.pool is None or fast.engine.pool.num_used == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_layers_in_one_call_compute_what_the_per_layer_calls_do(gemv, family_dir, dtype):
    """cpu_layers against Layer.fused over the same caches, 3 rows at different lengths: the same kernels in the
    same order, so the same bits, and the same K/V written."""
    from engine.kernels.cpu_layers import Paged
    model = stacked(family_dir, dtype, gemv)
    cfg = model.cfg
    g = torch.Generator().manual_seed(7)
    shape = (cfg.num_hidden_layers, 12, 16, cfg.num_key_value_heads, cfg.head_dim)
    k_cache, v_cache = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    lens = [5, 17, 40]
    tables = torch.tensor([[3, 0, 0], [7, 1, 0], [2, 9, 4]])
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    paged = Paged(k_cache, v_cache, slots, tables, torch.tensor(lens), cfg.attn_scale)
    x = torch.randn(3, cfg.hidden_size, generator=g).to(dtype)
    ropes = model.rope_tables(torch.tensor(lens) - 1, dtype)
    ops = select("cpu", "cpu", str(dtype).removeprefix("torch."))
    want_k, want_v = k_cache.clone(), v_cache.clone()

    def attn(layer, q, k, v):
        return ops.decode_step(q, k, v, want_k[layer], want_v[layer], slots, tables, paged.seq_lens, paged.scale,
                               cfg.windows[layer])
    with torch.inference_mode():
        want = x.clone()
        for i, layer in enumerate(model.layers):
            want = layer.fused(i, want, ropes[i], attn)
        got = model.stack(x.clone(), ropes, paged)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_torch_serves_small_weights_bf16_and_compiled_decode(tiny_dir, small_dir, monkeypatch):
    tiny = LLM(model=tiny_dir, dtype="float32").engine.runner
    if tiny.gemv is not None:
        assert all(mod.gemv is None for mod in tiny.model.layers.modules() if isinstance(mod, Linear))  # too small
        assert tiny.model.head_gemv is tiny.gemv                                                 # [1024, 64]
        assert all(layer.kernels is not None for layer in tiny.model.layers)    # fused calls take any size
    bf16 = LLM(model=small_dir, dtype="bfloat16").engine.runner
    if bf16.gemv is not None:                     # bf16 decode: the GEMV, the fused layers and the attention kernel
        assert bf16.model.head_gemv is bf16.gemv and bf16.ops.name == "cpu"
        assert all(layer.kernels is not None for layer in bf16.model.layers)
    half = LLM(model=small_dir, dtype="float16").engine.runner       # no kernel takes fp16: torch serves
    assert half.gemv is None and half.ops.name == "reference"
    assert all(layer.kernels is None for layer in half.model.layers)
    compiled = LLM(model=small_dir, dtype="float32", kv_storage="paged", compile=True).engine.runner
    if compiled.gemv is not None:       # fp32 decode on the fused kernels outruns the graph: compile stands down
        assert compiled.compiled is None and all(layer.kernels is not None for layer in compiled.model.layers)
    monkeypatch.setattr(cpu_pointwise, "load", lambda: None)          # no fused layers: the graph serves
    compiled = LLM(model=small_dir, dtype="float32", kv_storage="paged", compile=True).engine.runner
    assert compiled.compiled is not None
    assert all(layer.kernels is None for layer in compiled.model.layers)     # the graph fuses these itself
    assert all(mod.gemv is None for mod in compiled.model.modules() if isinstance(mod, Linear))   # all < 2 MiB


def test_bf16_model_logits_with_the_kernel_match_torch(gemv, small_dir):
    from engine.kernels.reference import causal_attention
    from engine.models.loader import load_model
    model = load_model(small_dir, "bfloat16")
    scale = model.cfg.head_dim ** -0.5
    ids, positions = torch.tensor(random_ids(6, seed=4)), torch.arange(6)     # 6 rows: the GEMV's range

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model.logits(model(ids, positions, lambda i, q, k, v: causal_attention(q, k, v, 0, scale)))
    model.use_gemv(gemv)
    got = logits()
    model.use_gemv(None)
    torch.testing.assert_close(got, logits(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("cxx, why", [("no-such-compiler", "no C++ compiler (no-such-compiler)"),
                                      ("false", "cpu_gemv.cpp -o")])        # a compiler that fails every source
def test_a_failed_build_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch, caplog, cxx, why):
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("not an AVX2 CPU: load() returns None before building")
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", cxx)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        assert cpu_gemv.load(threads=1) is None
    assert "CPU kernels unavailable" in caplog.text and why in caplog.text
    if cxx == "false":
        assert not list((tmp_path / "kernels").iterdir())          # nothing half-built left behind


def test_kill_switch(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "off")
    assert cpu_gemv.load(threads=1) is None
