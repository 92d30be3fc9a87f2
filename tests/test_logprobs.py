"""Logprobs (vLLM's shape and default raw_logprobs): each generated token's logprob, rank and the top ones, equal to
transformers' log-softmax on the same checkpoint; read back with the tokens, so lookahead keeps overlapping."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import greedy, random_ids, step


def reference_logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-softmax of transformers' logits at each generated position."""
    from transformers import Qwen2ForCausalLM
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(output)]


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_greedy_logprobs_match_transformers(model_dir, storage):
    prompt = random_ids(40, seed=3)
    llm = LLM(model=model_dir, dtype="float32", kv_storage=storage)
    out = llm.generate(prompt, greedy(12, logprobs=5))[0]
    ref = reference_logprobs(model_dir, prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 12
    for position, token, row in zip(out.logprobs, out.token_ids, ref):
        top = row.topk(5)
        assert position[token].rank == 1                                  # greedy: the most likely token
        assert list(position)[:5] == top.indices.tolist()                 # top 5, most likely first
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert position[t].logprob == pytest.approx(lp, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(out.logprobs, out.token_ids)))
    assert llm.engine.lookahead.pipelined > 0                            # overlap kept with logprobs on


def test_sampled_tokens_carry_their_raw_logprob_and_rank(tiny_dir):
    prompt = random_ids(30, seed=4)
    llm = LLM(model=tiny_dir, dtype="float32")
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.5, seed=7, ignore_eos=True,
                                              logprobs=0))[0]
    ref = reference_logprobs(tiny_dir, prompt, out.token_ids)
    for position, token, row in zip(out.logprobs, out.token_ids, ref):
        assert list(position) == [token]                                  # logprobs=0: the sampled token only
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)   # before temperature
        assert position[token].rank == int((row > row[token]).sum()) + 1
        assert position[token].decoded_token == llm.engine.tokenizer.token_text(token)


def test_lookahead_and_sync_give_the_same_logprobs(tiny_dir, monkeypatch):
    prompts = [random_ids(25, seed=s) for s in (5, 6)]
    params = [greedy(9, logprobs=2), greedy(6)]                          # one row asks, the other does not
    fast = LLM(model=tiny_dir, dtype="float32").generate(prompts, params)
    monkeypatch.setenv("PAGODA_FORCE_SYNC", "1")
    slow = LLM(model=tiny_dir, dtype="float32").generate(prompts, params)
    assert fast[1].logprobs is None and fast[1].cumulative_logprob is None
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    for a, b in zip(fast[0].logprobs, slow[0].logprobs):
        assert a.keys() == b.keys() and all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5) for t in a)


def test_deltas_carry_the_logprobs_of_their_tokens(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    engine = llm.engine
    req = engine.add(engine.make_request(random_ids(20, seed=8), greedy(8, logprobs=1)))
    deltas = []
    while engine.has_work:
        deltas += [d for d in step(engine) if d.request_id == req.id]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [p for d in deltas for p in d.logprobs] == req.logprobs
    assert deltas[-1].cumulative_logprob == pytest.approx(req.cumulative_logprob)


@pytest.mark.parametrize("value,message", [(21, "logprobs: must be <= 20"), (-1, "logprobs: must be >= 0"),
                                           ("x", "logprobs: expected an integer")])
def test_bad_logprobs_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({"logprobs": value})


def test_string_values_from_triton_clients():
    assert SamplingParams.from_dict({"logprobs": "3"}).logprobs == 3
    assert SamplingParams.from_dict({"logprobs": None}).logprobs is None
