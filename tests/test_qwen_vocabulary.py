"""The tiny-qwen preset carries Qwen2.5's own tokenizer and chat template (as qwen2.5-0.5b, the benchmarks' preset,
does at Qwen2.5-0.5B's geometry): special tokens, byte-level detokenization, grammars and logprobs are exercised on
the real 151,665-token vocabulary."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.helpers import greedy
from tests.test_logprobs import reference_logprobs
from tests.test_structured_output import SCHEMA


def test_the_tokenizer_and_chat_template_are_qwen25s(qwen_tiny_dir):
    tok = Tokenizer(qwen_tiny_dir)
    assert tok.vocab_size == 151665
    assert tok.encode("Hello, world") == [9707, 11, 1879]                   # Qwen's ids
    assert tok.encode("<|im_start|>") == [151644] and tok.decode([151645], skip_special_tokens=False) == "<|im_end|>"
    assert tok.decode(tok.encode("naïve 你好 🤖")) == "naïve 你好 🤖"          # byte-level, multi-byte characters
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads(Path(qwen_tiny_dir, "config.json").read_text())
    generation = json.loads(Path(qwen_tiny_dir, "generation_config.json").read_text())
    assert config["vocab_size"] == 151936 and generation["eos_token_id"] == [151645, 151643]


def test_special_tokens_are_skipped_or_kept_as_asked(qwen_tiny_dir):
    llm = LLM(model=qwen_tiny_dir, dtype="float32")
    ids = [9707, 151644, 11]
    shown = llm.generate(ids, greedy(4, logit_bias={151646: 100.0}, skip_special_tokens=False))[0]
    hidden = llm.generate(ids, greedy(4, logit_bias={151646: 100.0}))[0]
    assert shown.token_ids == [151646] * 4
    assert shown.text == "<|object_ref_start|>" * 4 and hidden.text == ""


def test_structured_output_and_logprobs_on_the_real_vocabulary(qwen_tiny_dir):
    llm = LLM(model=qwen_tiny_dir, dtype="float32", max_batch_size=4)
    prompt = llm.engine.tokenizer.encode("Return a person as JSON.")
    outs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=60, temperature=t, seed=i, logprobs=3,
                                                      structured_outputs={"json": SCHEMA})
                                       for i, t in enumerate([0.0, 1.0, 1.0])])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    plain = llm.generate(prompt, greedy(8, logprobs=5))[0]
    ref = reference_logprobs(qwen_tiny_dir, prompt, plain.token_ids)
    for position, token, row in zip(plain.logprobs, plain.token_ids, ref):
        top = row.topk(5)
        assert list(position)[:5] == top.indices.tolist()
        assert [position[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
