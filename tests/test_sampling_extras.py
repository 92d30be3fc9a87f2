"""The rest of vLLM's SamplingParams: prompt_logprobs (equal to transformers' log-softmax; no prefix-cache read, as
vLLM), bad_words (one-token words never sampled, longer ones cut at their last token, lookahead or not),
allowed_token_ids, truncate_prompt_tokens, spaces_between_special_tokens."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.bad_words import BadWords
from tests.helpers import greedy, random_ids
from tests.test_logprobs import reference_logprobs


@pytest.mark.parametrize("chunk", [512, 16])
def test_prompt_logprobs_match_transformers(tiny_dir, chunk):
    llm = LLM(model=tiny_dir, dtype="float32", prefill_chunk=chunk)
    prompt = random_ids(50, seed=8)
    llm.generate(prompt, greedy(2))                            # cached now: prompt_logprobs must not read it
    out = llm.generate(prompt, greedy(3, prompt_logprobs=3))[0]
    ref = reference_logprobs(tiny_dir, prompt[:1], prompt[1:])
    assert out.cached_tokens == 0 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 50
    for i, position in enumerate(out.prompt_logprobs[1:]):
        token, row = prompt[i + 1], ref[i]
        assert list(position)[0] == token                       # the prompt's own token first, then the top 3
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert position[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(position)
        assert [position[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
    grouped = llm.generate(prompt, SamplingParams(n=2, max_tokens=3, prompt_logprobs=0, seed=1))[0]
    assert [p and list(p) for p in grouped.prompt_logprobs] == [None, *[[t] for t in prompt[1:]]]


def test_bad_words_are_never_generated(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    tok = llm.engine.tokenizer
    prompt = random_ids(30, seed=3)
    plain = llm.generate(prompt, greedy(40))[0].token_ids
    # a two-token word the plain output holds, as the word's own tokenization, and its first token's text
    word = next(text for i in range(len(plain) - 2) if len(seq := tok.encode((text := tok.decode(plain[i:i + 2]))
                .lstrip())) == 2 and any(plain[j:j + 2] == seq for j in range(len(plain))))
    words = [word, tok.decode([plain[0]])]
    bad = BadWords.of(words, tok.encode)
    assert bad.sequences
    for lookahead in (True, False):
        llm.engine.lookahead.enabled = lookahead
        out = llm.generate(prompt, greedy(40, bad_words=words))[0].token_ids
        assert out != plain and not set(bad.always) & set(out)
        assert not any(out[i:i + len(s)] == s for s in bad.sequences for i in range(len(out)))
        if lookahead:
            first = out
    assert out == first                                         # the same with and without lookahead


def test_bad_words_bans_follow_the_output():
    bad = BadWords([5], [[1, 2, 3], [7, 8]])
    assert bad.banned([9, 1, 2]) == [3] and bad.banned([7]) == [8] and bad.banned([2, 1]) == []
    assert BadWords.of(["ab"], lambda s: {"ab": [4], " ab": [6]}[s]) == BadWords((4, 6), [])


def test_allowed_token_ids_and_truncation(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_model_len=64)
    for temperature in (0.0, 1.0):
        out = llm.generate([5, 6, 7], SamplingParams(max_tokens=12, temperature=temperature, seed=1, ignore_eos=True,
                                                     allowed_token_ids=[40, 41, 42]))[0]
        assert set(out.token_ids) <= {40, 41, 42}
    long = random_ids(100, seed=4)
    cut = llm.generate(long, greedy(4, truncate_prompt_tokens=10))[0]
    assert cut.num_prompt_tokens == 10 and cut.token_ids == llm.generate(long[-10:], greedy(4))[0].token_ids
    assert llm.generate(long, greedy(1, truncate_prompt_tokens=-1))[0].num_prompt_tokens == 63
    with pytest.raises(ValueError, match="allowed_token_ids: token id 5000 is outside"):
        llm.generate([5], SamplingParams(allowed_token_ids=[5000]))
    for bad, message in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be >= 1 or -1"),
                         ({"bad_words": ["ok", ""]}, "bad_words: must be a list of non-empty strings"),
                         ({"allowed_token_ids": []}, "allowed_token_ids: must be a non-empty list"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs: must be <= 20"),
                         ({"spaces_between_special_tokens": "maybe"}, "spaces_between_special_tokens: expected")):
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_dict(bad)
    assert SamplingParams.from_dict({"spaces_between_special_tokens": "false"}).spaces_between_special_tokens is False
