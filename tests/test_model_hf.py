"""Correctness anchor: logits equal transformers' Qwen2ForCausalLM on the same checkpoint (fp32)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.kernels import select
from engine.models.loader import load_model
from engine.runners.base import Row
from engine.runners.torch import attention as torch_attention
from tests.helpers import random_ids

REFERENCE = select("reference", "cpu")

transformers = pytest.importorskip("transformers")


def hf_model(path):
    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def paged_logits(model, ids: list[int], start: int, k_cache, v_cache, table: list[int]) -> torch.Tensor:
    bs = k_cache.shape[2]
    slots = [table[p // bs] * bs + p % bs for p in range(start, start + len(ids))]
    row = Row(0, start, ids, slots=slots, block_table=table)
    attn = torch_attention.paged(REFERENCE, k_cache, v_cache, [row], model.cfg.head_dim ** -0.5, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn)
        return model.logits(hidden)


def caches(model, blocks: int = 8, bs: int = 16):
    cfg = model.cfg
    shape = (cfg.num_hidden_layers, blocks, bs, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


def test_prefill_and_decode_match_transformers(model_dir):
    ids = random_ids(40, seed=3)
    ref_model = hf_model(model_dir)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    model = load_model(model_dir, "float32")
    k, v = caches(model)
    table = [5, 2, 7]          # non-contiguous on purpose
    prefill = paged_logits(model, ids[:30], 0, k, v, table)
    assert (prefill - ref[:30]).abs().max().item() <= 1e-4
    for p in range(30, 40):    # step-by-step decode against the cache
        step = paged_logits(model, [ids[p]], p, k, v, table)
        assert (step[0] - ref[p]).abs().max().item() <= 1e-4


def test_sharded_checkpoint_and_dtype(tiny_dir, tmp_path):
    """A sharded checkpoint with an index loads to the same weights; dtype=bfloat16 converts."""
    state = load_file(f"{tiny_dir}/model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{tiny_dir}/{f}", tmp_path / f)
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(tiny_dir, "float32"), load_model(tmp_path, "float32")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert load_model(tmp_path, "bfloat16").embed.weight.dtype == torch.bfloat16
    assert load_model(tmp_path, "auto").embed.weight.dtype == torch.float32


def test_missing_weights_are_named(tiny_dir, tmp_path):
    state = load_file(f"{tiny_dir}/model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(f"{tiny_dir}/{f}", tmp_path / f)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.down"):
        load_model(tmp_path)


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_engine_decodes_transformers_greedy_tokens(tmp_path_factory, storage):
    """The engine as it serves (fp32, the CPU kernels where they build: all layers in one call for paged, six calls
    a layer for dense) generates transformers' greedy tokens on `small`. Here the top two logits of every step sit
    0.12 or more apart, far above fp32 noise."""
    from engine import LLM, SamplingParams
    from engine.models.presets import make_model
    path = str(make_model("small", tmp_path_factory.mktemp("small"), seed=0))
    ids = random_ids(40, seed=1)
    with torch.no_grad():
        out = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                      pad_token_id=0)
    llm = LLM(model=path, dtype="float32", max_batch_size=2, kv_storage=storage)
    got = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    assert got == out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch,message", [
    (["Phi3ForCausalLM"], "model: architecture 'Phi3ForCausalLM' is not supported (supported: Qwen2ForCausalLM, "
                          "LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM)"),
    (None, "model: model_type 'phi3' is not supported"),
])
def test_unknown_architectures_are_refused_by_name_before_any_weight_is_read(tiny_dir, tmp_path, monkeypatch,
                                                                             arch, message):
    from engine import LLM
    config = json.loads((Path(tiny_dir) / "config.json").read_text())
    config.pop("architectures")
    config["model_type"] = "phi3"
    if arch:
        config["architectures"] = arch
    for f in ("tokenizer.json", "model.safetensors"):
        shutil.copy(Path(tiny_dir) / f, tmp_path / f)
    (tmp_path / "config.json").write_text(json.dumps(config))
    opened = []
    monkeypatch.setattr("engine.models.loader.safe_open", lambda *a, **k: opened.append(a) or 1 / 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(tmp_path))
    assert opened == []
