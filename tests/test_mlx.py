"""The MLX runner (mlx[cpu] here) against the torch runner: logits, greedy tokens, prompt-cache hits, sampling."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import select
from engine.models.loader import load_model
from engine.runners.base import Row
from engine.runners.torch import attention as torch_attention
from tests.helpers import random_ids
from tests.helpers import run_workload as run

mx = pytest.importorskip("mlx.core")

from engine.models.decoder_mlx import load_mlx  # noqa: E402
from engine.runners.mlx import attention as mlx_attention  # noqa: E402

REFERENCE = select("reference", "cpu")


@pytest.mark.parametrize("contiguous", [True, False], ids=["cpu-layout", "gpu-layout"])
def test_logits_match_torch(model_dir, contiguous):
    """Both weight layouts (copies laid out [in, out] on the CPU, transposed views on a GPU) against torch."""
    ids = random_ids(40, seed=3)
    table, bs = [5, 2, 7], 16
    slots = lambda a, b: [table[p // bs] * bs + p % bs for p in range(a, b)]   # noqa: E731
    tm = load_model(model_dir, "float32")
    cfg = tm.cfg
    shape = (cfg.num_hidden_layers, 8, bs, cfg.num_key_value_heads, cfg.head_dim)
    tk, tv = torch.zeros(shape), torch.zeros(shape)
    mm = load_mlx(model_dir, "float32", contiguous)
    assert mm.layers[0].gate_up.shape == (cfg.hidden_size, 2 * cfg.intermediate_size)
    flat = (8 * bs, cfg.num_key_value_heads, cfg.head_dim)
    mk = [mx.zeros(flat) for _ in range(cfg.num_hidden_layers)]
    mv = [mx.zeros(flat) for _ in range(cfg.num_hidden_layers)]
    scale = cfg.head_dim ** -0.5
    for start, end in [(0, 30)] + [(p, p + 1) for p in range(30, 40)]:    # prefill, then step-by-step decode
        row = Row(0, start, ids[start:end], slots=slots(start, end), block_table=table)
        with torch.inference_mode():
            attn = torch_attention.paged(REFERENCE, tk, tv, [row], scale, torch.device("cpu"))
            expect = tm.logits(tm(torch.tensor(ids[start:end]), torch.arange(start, end), attn)).numpy()
        got = mm.logits(mm.forward(mx.array(ids[start:end]), mx.arange(start, end),
                                   mlx_attention.paged(mk, mv, bs, [row], scale)))
        assert np.abs(np.array(got) - expect).max() <= 1e-4


@pytest.fixture
def torch_reference(model_dir) -> tuple[list[list[int]], list[int]]:
    llm = LLM(model=model_dir, kv_storage="paged", lookahead=False, dtype="float32")
    cold, _ = run(llm, batch=False)
    _, hit_cached = run(llm, batch=False)
    return cold, hit_cached


@pytest.mark.parametrize("storage,lookahead,batch", list(itertools.product(["paged", "dense"], [True, False],
                                                                          [False, True])))
def test_greedy_tokens_and_cache_hits_match_torch(model_dir, torch_reference, storage, lookahead, batch):
    expected, torch_cached = torch_reference
    llm = LLM(model=model_dir, runner="mlx", kv_storage=storage, lookahead=lookahead, dtype="float32")
    cold, cold_cached = run(llm, batch)
    hit, hit_cached = run(llm, batch)
    assert cold == expected and hit == expected
    assert cold_cached == [0, 0, 0, 0]
    if storage == "paged":
        assert hit_cached == torch_cached          # the same adoption as the torch runner
    else:
        assert all(c > 0 for c in hit_cached)
    dense_torch = LLM(model=model_dir, kv_storage="dense", dtype="float32") if storage == "dense" else None
    if dense_torch is not None:
        run(dense_torch, batch)
        assert run(dense_torch, batch)[1] == hit_cached


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_logprobs_match_torch(model_dir, storage):
    prompts = [random_ids(30, seed=12), random_ids(18, seed=13)]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    want = LLM(model=model_dir, dtype="float32", kv_storage=storage).generate(prompts, params)
    got = LLM(model=model_dir, runner="mlx", dtype="float32", kv_storage=storage).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and got[1].logprobs is None
    for g, w in zip(got[0].logprobs, want[0].logprobs):
        assert list(g) == list(w) and all(g[t].rank == w[t].rank for t in g)
        assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) for t in g)
    assert got[0].cumulative_logprob == pytest.approx(want[0].cumulative_logprob, abs=1e-3)


def test_sampling_is_seeded_and_respects_top_k(tiny_dir):
    llm = LLM(model=tiny_dir, runner="mlx", dtype="float32")
    p = SamplingParams(max_tokens=15, temperature=0.8, top_k=5, top_p=0.9, seed=3, ignore_eos=True)
    a = llm.generate(random_ids(20, seed=1), p)[0].token_ids
    b = llm.generate(random_ids(20, seed=1), p)[0].token_ids
    c = llm.generate(random_ids(20, seed=1), SamplingParams(max_tokens=15, temperature=0.8, seed=4,
                                                            ignore_eos=True))[0].token_ids
    assert a == b and a != c and len(a) == 15
    greedy = llm.generate(random_ids(20, seed=1), SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))
    top1 = llm.generate(random_ids(20, seed=1), SamplingParams(max_tokens=15, top_k=1, seed=9, ignore_eos=True))
    assert greedy[0].token_ids == top1[0].token_ids


def test_lookahead_counts_and_unwind_on_mlx(tiny_dir):
    llm = LLM(model=tiny_dir, runner="mlx", dtype="float32")
    out = llm.generate(random_ids(20, seed=1), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    m = llm.engine.metrics
    assert len(out.token_ids) == 64 and m.value("pagoda_decode_lookahead_steps_total") == 62
    ids = out.token_ids
    k = next(i for i in range(5, 64) if ids[i] not in ids[:i])      # a token first produced at step k
    cut = llm.generate(random_ids(20, seed=1), SamplingParams(max_tokens=64, temperature=0,
                                                               stop_token_ids=[ids[k]]))[0]
    assert cut.token_ids == ids[:k + 1] and m.value("pagoda_lookahead_unwinds_total") == 1
    assert llm.engine.kv.stats()["used"] == 0


def test_async_engine_thread_and_server_runner(tiny_dir):
    """The engine loop runs on its own thread; MLX streams are per thread, so this must work there too."""
    import asyncio

    from engine.config import EngineConfig
    from engine.serving.threaded import ThreadedEngine
    eng = ThreadedEngine(EngineConfig(model=tiny_dir, runner="mlx", dtype="float32"))
    try:
        async def main():
            return [d async for d in eng.generate(random_ids(30, seed=2),
                                                  SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
        deltas = asyncio.run(main())
    finally:
        eng.shutdown()
    expected = LLM(model=tiny_dir, dtype="float32").generate(random_ids(30, seed=2),
                                                             SamplingParams(max_tokens=6, temperature=0))[0]
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
