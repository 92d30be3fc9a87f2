"""Every family against transformers (fp32) on random checkpoints transformers itself wrote, at geometries other than
the presets', with prompts longer than the sliding windows: logits within 1e-4 (prefill in chunks, then decode,
paged and dense), and greedy tokens across {paged, dense} x {lookahead, sync} x {cold, hit} x {alone, batch of 4}."""
from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import select
from engine.models.loader import load_model
from engine.runners.base import Row
from engine.runners.torch import attention as torch_attention
from tests.helpers import greedy, random_ids, workload_params, workload_prompts

transformers = pytest.importorskip("transformers")

GEOMETRY = dict(vocab_size=1024, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(head_dim=16, rope_theta=500000.0, rope_scaling=LLAMA3, tie_word_embeddings=True)),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM",
                     dict(attention_bias=True, mlp_bias=True, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=24, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=24, sliding_window=20, sliding_window_pattern=2, query_pre_attn_scalar=20,
                    final_logit_softcapping=30.0, rope_scaling=dict(rope_type="linear", factor=4.0),
                    rope_local_base_freq=5000.0)),
}


def write(family: str, path, tokenizer_dir) -> None:
    """A checkpoint as transformers writes it; every weight random (norms and biases too, so each one counts)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**GEOMETRY, **extra)
    torch.manual_seed(list(FAMILIES).index(family))
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", path / name)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory, tiny_dir):
    path = tmp_path_factory.mktemp(request.param)
    write(request.param, path, tiny_dir)
    return path


def hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_config_read_as_transformers_reads_it(family_dir):
    ours = load_model(family_dir, "float32").cfg
    theirs = transformers.AutoConfig.from_pretrained(family_dir)
    assert ours.head_dim == getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    types = getattr(theirs, "layer_types", None)
    if types is None:                  # Mistral: every layer slides when it has a window
        window = getattr(theirs, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * theirs.num_hidden_layers
    assert ours.layer_types == list(types)
    assert any(ours.windows) == ("sliding_attention" in types)


def test_logits_match_transformers(family_dir):
    """Prefill in chunks over a non-contiguous block table, then one token at a time; dense the same way."""
    ids = random_ids(70, seed=5)
    with torch.no_grad():
        ref = hf(family_dir)(torch.tensor([ids])).logits[0]
    model = load_model(family_dir, "float32")
    cfg = model.cfg
    bs, table = 16, [6, 1, 4, 0, 3]
    shape = (cfg.num_hidden_layers, 8, bs, cfg.num_key_value_heads, cfg.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    dense = {0: torch.zeros((cfg.num_hidden_layers, 2, 128, cfg.num_key_value_heads, cfg.head_dim))}
    spans = [(0, 23), (23, 50)] + [(p, p + 1) for p in range(50, 70)]
    for start, end in spans:
        chunk = ids[start:end]
        row = Row(0, start, chunk, slots=[table[p // bs] * bs + p % bs for p in range(start, end)],
                  block_table=table, buf=0)
        positions = torch.arange(start, end)
        with torch.inference_mode():
            paged = model.logits(model(torch.tensor(chunk), positions, torch_attention.paged(
                select("reference", "cpu"), k, v, [row], cfg.attn_scale, torch.device("cpu"), cfg.windows)))
            flat = model.logits(model(torch.tensor(chunk), positions,
                                      torch_attention.dense(dense, [row], cfg.attn_scale, cfg.windows)))
        assert (paged - ref[start:end]).abs().max().item() <= 1e-4, (start, end)
        assert (flat - ref[start:end]).abs().max().item() <= 1e-4, (start, end)


def test_mlx_logits_match_transformers(family_dir):
    mx = pytest.importorskip("mlx.core")
    from engine.models.decoder_mlx import load_mlx
    from engine.runners.mlx import attention as mlx_attention
    ids = random_ids(70, seed=5)
    with torch.no_grad():
        ref = hf(family_dir)(torch.tensor([ids])).logits[0].numpy()
    model = load_mlx(family_dir, "float32")
    cfg = model.cfg
    bs, table = 16, [6, 1, 4, 0, 3]
    flat = (8 * bs, cfg.num_key_value_heads, cfg.head_dim)
    k = [mx.zeros(flat) for _ in range(cfg.num_hidden_layers)]
    v = [mx.zeros(flat) for _ in range(cfg.num_hidden_layers)]
    for start, end in [(0, 23), (23, 50)] + [(p, p + 1) for p in range(50, 70)]:
        row = Row(0, start, ids[start:end], slots=[table[p // bs] * bs + p % bs for p in range(start, end)],
                  block_table=table)
        got = model.logits(model.forward(mx.array(ids[start:end]), mx.arange(start, end),
                                         mlx_attention.paged(k, v, bs, [row], cfg.attn_scale, cfg.windows)))
        assert abs(np.array(got) - ref[start:end]).max() <= 1e-4, (start, end)


@pytest.fixture(scope="module")
def reference(family_dir) -> list[list[int]]:
    model = hf(family_dir)
    return [hf_greedy(model, p, sp.max_tokens) for p, sp in zip(workload_prompts(), workload_params())]


@pytest.mark.parametrize("runner,storage,lookahead,batch", list(itertools.product(
    ["torch", "mlx"], ["paged", "dense"], [True, False], [False, True])))
def test_greedy_tokens_match_transformers(family_dir, reference, runner, storage, lookahead, batch):
    if runner == "mlx":
        pytest.importorskip("mlx.core")
    llm = LLM(model=str(family_dir), runner=runner, kv_storage=storage, lookahead=lookahead, dtype="float32",
              prefill_chunk=32)
    for attempt in ("cold", "hit"):
        if batch:
            outs = llm.generate(workload_prompts(), workload_params())
        else:
            outs = [llm.generate(p, sp)[0] for p, sp in zip(workload_prompts(), workload_params())]
        assert [o.token_ids for o in outs] == reference, attempt
        cached = [o.cached_tokens for o in outs]
        assert all(c > 0 for c in cached) if attempt == "hit" else cached == [0, 0, 0, 0]


def test_logprobs_match_transformers(family_dir):
    """Greedy logprobs (top 5) within 1e-4 of transformers' log-softmax, prompt longer than the window."""
    prompt = random_ids(60, seed=3)
    out = LLM(model=str(family_dir), dtype="float32").generate(prompt, greedy(10, logprobs=5))[0]
    with torch.no_grad():
        logits = hf(family_dir)(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(out.token_ids)]
    for position, row in zip(out.logprobs, ref):
        top = row.topk(5)
        assert list(position)[:5] == top.indices.tolist()
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert position[t].logprob == pytest.approx(lp, abs=1e-4)


def test_sampling_features_hold(family_dir):
    """n > 1 with a seed, penalties and a grammar on every family: seeded samples repeat, penalties change what is
    picked, the grammar's choices are the only outputs."""
    llm = LLM(model=str(family_dir), dtype="float32")
    prompt = random_ids(50, seed=9)
    seeded = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    first, again = (llm.generate(prompt, seeded)[0] for _ in range(2))
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    plain = llm.generate(prompt, greedy(24))[0].token_ids
    penalized = llm.generate(prompt, greedy(24, repetition_penalty=5.0))[0].token_ids
    if len(set(plain)) < len(plain):            # a repeat the penalty must have discouraged
        assert penalized != plain
    choices = ["yes", "no", "it depends"]
    text = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                               structured_outputs={"choice": choices}))[0].text
    assert text in choices


def test_the_tokenizer_eos_stops_as_the_config_eos_does(family_dir, tmp_path):
    """vLLM stops on the tokenizer's eos_token besides the checkpoint's EOS ids; with neither, a grammar (which ends
    on one) is refused by name instead of failing inside xgrammar."""
    llm = LLM(model=str(family_dir), dtype="float32")
    eos = llm.engine.tokenizer.tok.token_to_id("<|im_end|>")          # the copied tokenizer_config's eos_token
    assert eos in llm.engine.output.eos_token_ids
    bare = tmp_path / "bare"
    shutil.copytree(family_dir, bare)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = bare / name
        if path.exists():
            data = json.loads(path.read_text())
            for key in ("eos_token_id", "eos_token"):
                data.pop(key, None)
            path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="structured_outputs: this model names no end-of-sequence token"):
        LLM(model=str(bare), dtype="float32").generate([5, 6, 7], SamplingParams(
            max_tokens=4, structured_outputs={"choice": ["yes", "no"]}))
