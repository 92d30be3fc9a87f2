"""Dense KV (a buffer per sequence: max_batch_size=1, or kv_storage=dense) through the one-call decoder stack
(cpu_layers.cpp): the same bits as the per-layer fused calls over the same buffers, and the same greedy tokens as
the engine's per-layer path."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_layers, select
from engine.kernels.cpu_layers import Dense
from engine.models.presets import make_model
from tests.helpers import random_ids, stacked


@pytest.fixture(scope="module", params=["small", "tiny-gemma3"])
def model_dir(request, tmp_path_factory) -> str:
    """Qwen2, and Gemma 3 (sliding windows, two RoPEs, sandwich norms)."""
    return str(make_model(request.param, tmp_path_factory.mktemp(request.param), seed=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_stack_computes_what_the_per_layer_calls_do(gemv, model_dir, dtype):
    """Three rows, each its own buffer of another capacity and at another length; the per-layer calls attend with
    the same kernel (a buffer's layer as one block), so the same bits and the same K/V written."""
    model = stacked(model_dir, dtype, gemv)
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    caps, lens = [8, 40, 64], [5, 17, 40]
    bufs = [torch.randn(cfg.num_hidden_layers, 2, cap, cfg.num_key_value_heads, cfg.head_dim,
                        generator=g).to(dtype) for cap in caps]
    x = torch.randn(3, cfg.hidden_size, generator=g).to(dtype)
    ropes = model.rope_tables(torch.tensor(lens) - 1, dtype)
    ops = select("cpu", "cpu", str(dtype).removeprefix("torch."))
    want_bufs = [b.clone() for b in bufs]

    def attn(layer, q, k, v):
        return torch.cat([ops.decode_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], buf[layer, 0].unsqueeze(0),
                                          buf[layer, 1].unsqueeze(0), torch.tensor([n - 1]), torch.tensor([[0]]),
                                          torch.tensor([n]), cfg.attn_scale, cfg.windows[layer])
                          for i, (buf, n) in enumerate(zip(want_bufs, lens))])
    with torch.inference_mode():
        want = x.clone()
        for i, layer in enumerate(model.layers):
            want = layer.fused(i, want, ropes[i], attn)
        got = model.stack(x.clone(), ropes, Dense(bufs, torch.tensor(lens), cfg.attn_scale))
    assert torch.equal(got, want)
    assert all(torch.equal(b, w) for b, w in zip(bufs, want_bufs))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_decode_in_one_call_generates_what_the_per_layer_path_does(gemv, model_dir, dtype, monkeypatch):
    """max_batch_size=1 (dense KV): every decode step in one stack call, the same greedy tokens as with the stack
    off (the per-layer fused calls over the torch reference attention)."""
    stacks = []
    real = cpu_layers.CpuLayers.__call__
    monkeypatch.setattr(cpu_layers.CpuLayers, "__call__", lambda self, x, *a: stacks.append(x.shape[0])
                        or real(self, x, *a))
    prompts = [random_ids(30, seed=4), random_ids(11, seed=5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    fast = LLM(model=model_dir, dtype=dtype, max_batch_size=1)
    assert not fast.engine.config.paged and fast.engine.runner.model.stack is not None
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert len(stacks) >= 2 * 19 and set(stacks) == {1}
    per_layer = LLM(model=model_dir, dtype=dtype, max_batch_size=1)
    per_layer.engine.runner.model.stack = None
    assert [o.token_ids for o in per_layer.generate(prompts, params)] == got
