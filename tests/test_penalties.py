"""Penalties, logit bias and min_p as vLLM defines them: greedy output under each equals an independent reference
(transformers' logits, penalized in this file step by step); lookahead and sync agree; preemption keeps the counts."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import greedy, random_ids


def reference(model_dir: str, prompt: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
              repetition: float = 1.0, bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decode with transformers, applying vLLM's definitions to each step's logits."""
    from transformers import Qwen2ForCausalLM
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for t, b in (bias or {}).items():
            logits[t] += b
        counts = Counter(out)
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, c in counts.items():
            logits[t] -= frequency * c + presence
        out.append(int(logits.argmax()))
    return out


CASES = {"frequency": dict(frequency_penalty=1.5), "presence": dict(presence_penalty=1.2),
         "repetition": dict(repetition_penalty=1.8), "negative frequency": dict(frequency_penalty=-0.7),
         "logit bias": dict(logit_bias={7: 4.0, 9: 3.0})}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_greedy_under_each_penalty_is_vllms_definition(tiny_dir, case, storage):
    prompt = random_ids(12, seed=21)
    params = CASES[case]
    got = LLM(model=tiny_dir, dtype="float32", kv_storage=storage).generate(prompt, greedy(16, **params))[0]
    want = reference(tiny_dir, prompt, 16, params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0),
                     params.get("repetition_penalty", 1.0), params.get("logit_bias"))
    assert got.token_ids == want
    assert got.token_ids != LLM(model=tiny_dir, dtype="float32").generate(prompt, greedy(16))[0].token_ids


def test_lookahead_sync_and_a_neighbour_without_penalties(tiny_dir, monkeypatch):
    prompts = [random_ids(12, seed=21), random_ids(15, seed=22)]
    params = [greedy(16, frequency_penalty=1.5), greedy(12)]
    fast = LLM(model=tiny_dir, dtype="float32")
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert fast.engine.lookahead.pipelined > 0
    monkeypatch.setenv("PAGODA_FORCE_SYNC", "1")
    assert got == [o.token_ids for o in LLM(model=tiny_dir, dtype="float32").generate(prompts, params)]
    assert got[1] == LLM(model=tiny_dir, dtype="float32").generate(prompts[1], greedy(12))[0].token_ids


def test_preempted_requests_keep_their_counts(tiny_dir):
    """Three penalized requests over a pool too small for all: they preempt and recompute, and each still
    decodes what it decodes alone."""
    prompts = [random_ids(100, seed=40 + i) for i in range(3)]
    params = greedy(120, frequency_penalty=1.0, repetition_penalty=1.3)
    crowded = LLM(model=tiny_dir, dtype="float32", max_batch_size=3, kv_storage="paged", num_kv_blocks=14)
    got = [o.token_ids for o in crowded.generate(prompts, params)]
    assert crowded.engine.metrics.value("pagoda_preemptions_total") > 0
    alone = LLM(model=tiny_dir, dtype="float32", max_batch_size=1)
    assert got == [alone.generate(p, params)[0].token_ids for p in prompts]


def test_min_p_of_one_keeps_only_the_most_likely_token(tiny_dir):
    prompt = random_ids(20, seed=23)
    llm = LLM(model=tiny_dir, dtype="float32")
    sampled = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3, min_p=1.0,
                                                  ignore_eos=True))[0]
    assert sampled.token_ids == llm.generate(prompt, greedy(12))[0].token_ids


@pytest.mark.parametrize("params,message", [
    ({"presence_penalty": 2.5}, "presence_penalty: must be in"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"), ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"5": "x"}}, "logit_bias"),
])
def test_bad_values_name_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)


def test_logit_bias_is_clamped_as_vllm_does():
    assert SamplingParams.from_dict({"logit_bias": {"5": 250, "6": -300}}).logit_bias == {5: 100.0, 6: -100.0}


def test_vllm_keys_not_honoured_yet_are_refused_by_name_unless_they_ask_for_nothing():
    with pytest.raises(ValueError, match="best_of: not supported by this server yet"):
        SamplingParams.from_dict({"best_of": 3})
    with pytest.raises(ValueError, match="lora_name: not supported"):
        SamplingParams.from_dict({"lora_name": "adapter"})
    neutral = {"best_of": "1", "detokenize": "true", "lora_name": None, "max_tokens": 3}
    assert SamplingParams.from_dict(neutral).max_tokens == 3


def test_logit_bias_outside_the_vocabulary_and_the_mlx_runner_refuse(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    with pytest.raises(ValueError, match="logit_bias: token id 5000 is outside the vocabulary"):
        llm.engine.make_request([5, 6], greedy(2, logit_bias={5000: 1.0}))
    pytest.importorskip("mlx.core")
    mlx = LLM(model=tiny_dir, runner="mlx", dtype="float32")
    with pytest.raises(ValueError, match="presence_penalty: not supported by the MLX runner"):
        mlx.engine.make_request([5, 6], greedy(2, presence_penalty=0.5))
