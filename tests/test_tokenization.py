"""Prompts tokenized as Hugging Face does for each family: a raw prompt gets what the tokenizer's post-processor adds
(Llama 3's <|begin_of_text|>; nothing for Qwen), a chat prompt only what its template writes (one BOS, never two), as
vLLM's add_special_tokens (true for completions, false after a chat template)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.conftest import made
from tests.helpers import post, start_openai

transformers = pytest.importorskip("transformers")

TEXT = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
BOS = {"tiny-llama": 128000}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-qwen", "tiny"])
def preset_dir(request, tmp_path_factory):
    return request.param, made(tmp_path_factory, request.param)


def hf_chat(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_raw_and_chat_prompts_are_tokenized_as_transformers_does(preset_dir):
    name, path = preset_dir
    ours, theirs = Tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    raw = ours.encode_prompt(TEXT)
    assert raw == theirs(TEXT).input_ids
    chat = ours.encode(ours.apply_chat_template(CHAT))
    assert chat == hf_chat(theirs, CHAT)
    bos = BOS.get(name)
    if bos is None:                    # Qwen and the trained tokenizers add nothing to a raw prompt
        assert raw == ours.encode(TEXT)
    else:
        assert raw[0] == bos and raw.count(bos) == 1
        assert chat[0] == bos and chat.count(bos) == 1


def test_the_engine_counts_the_bos_of_a_raw_prompt(tmp_path_factory):
    path = made(tmp_path_factory, "tiny-llama")
    out = LLM(model=path, dtype="float32").generate(TEXT, SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.num_prompt_tokens == len(transformers.AutoTokenizer.from_pretrained(path)(TEXT).input_ids)


def test_openai_server_adds_bos_to_completions_and_not_after_the_chat_template(tmp_path_factory, tmp_path):
    path = made(tmp_path_factory, "tiny-llama")
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    proc, url = start_openai(path, tmp_path / "server.log")
    try:
        with urllib.request.urlopen(f"http://{url}/v1/models", timeout=30) as resp:
            name = json.loads(resp.read())["data"][0]["id"]
        status, chat = post(url, "/v1/chat/completions/render", {"model": name, "messages": CHAT})
        assert status == 200, chat
        assert chat["token_ids"] == hf_chat(theirs, CHAT)
        status, done = post(url, "/v1/completions/render", {"model": name, "prompt": TEXT})
        assert status == 200, done
        assert done[0]["token_ids"] == theirs(TEXT).input_ids
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_blanks_are_the_indentation_tokens_code_encodes_to(preset_dir):
    """The speculative proposer's layout of the vocabulary: blanks (tokens of spaces and tabs alone), each the token
    its text encodes to, with code's indentation, as each family's tokenizer splits it, among them; and the tokens
    that end a line, each one before an indentation among them."""
    _, path = preset_dir
    tok = Tokenizer(path)
    blanks, breaks = tok.layout()
    assert blanks and all(not text.strip(" \t") and tok.encode(text) == [t] for t, text in blanks.items())
    code = tok.encode("def f():\n    if x:\n        return 1\n\tpass\n            y = 2")
    indents = [i for i, t in enumerate(code) if tok.token_text(t) and not tok.token_text(t).strip(" \t")]
    assert indents and all(code[i] in blanks for i in indents)
    assert all(code[i - 1] in breaks for i in indents if tok.token_text(code[i - 1]).endswith("\n"))
    assert sum(code[i - 1] in breaks for i in indents) >= 3      # three of the five lines are indented by a blank
    assert not breaks & set(blanks) and all(tok.token_text(t).endswith("\n") for t in list(breaks)[:50])
