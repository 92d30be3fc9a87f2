"""A GGUF file served as users serve it: named in config.pbtxt under a real tritonserver, and by the OpenAI server
with the chat template the file carries."""
from __future__ import annotations

import json
import signal

import pytest

from engine import LLM, SamplingParams
from engine.kernels import cpu_build
from engine.models.presets import cached_model
from scripts import tritonserver as triton_server
from tests.helpers import post, random_ids, stop_checked, triton_post
from tests.helpers import start_openai as start
from tests.test_gguf import write

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpu_build.library() is None, reason="no CPU kernels here (x86 with AVX2 only)")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    src = cached_model("tiny")
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    return write(src, tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf", "Q8_0", template)


def test_a_file_named_in_config_pbtxt_serves_under_tritonserver(gguf, tmp_path):
    model = tmp_path / "repo" / "llm"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text((triton_server.ROOT / "model_repository/llm/1/model.py").read_text())
    config = (triton_server.ROOT / "model_repository/llm/config.pbtxt").read_text()
    assert 'key: "model", value: { string_value: "" }' in config
    (model / "config.pbtxt").write_text(config.replace('key: "model", value: { string_value: "" }',
                                                       f'key: "model", value: {{ string_value: "{gguf}" }}'))
    ids = random_ids(30, seed=8)
    want = LLM(model=str(gguf)).generate(ids, SamplingParams(max_tokens=6, temperature=0))[0]
    srv = triton_server.launch({}, tmp_path / "log.txt", repository=model.parent)
    try:
        status, body = triton_post(srv, "/v2/models/llm/generate",
                                   {"input_ids": ids, "exclude_input_in_output": True,
                                    "sampling_parameters": json.dumps({"max_tokens": 6, "temperature": 0})})
        assert status == 200 and json.loads(body)["output_ids"] == want.token_ids
    finally:
        stop_checked(srv)


def test_the_openai_server_chats_with_the_files_own_template(gguf, tmp_path):
    proc, url = start(str(gguf), tmp_path / "server.log")
    try:
        messages = [{"role": "user", "content": "hello there"}]
        status, out = post(url, "/v1/chat/completions", {"model": "tiny-q8", "messages": messages, "max_tokens": 5,
                                                         "temperature": 0})
        assert status == 200, out
        llm = LLM(model=str(gguf), dtype="float32")
        prompt = llm.engine.tokenizer.apply_chat_template(messages)
        assert prompt.startswith("<|im_start|>user")                 # the template the file carries
        want = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0))[0]
        assert out["choices"][0]["token_ids"] == want.token_ids
        assert out["usage"]["prompt_tokens"] == len(llm.engine.tokenizer.encode_prompt(prompt))
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM)
