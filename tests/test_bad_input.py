"""Bad input through the real front ends: the Triton model in a real tritonserver (gRPC and HTTP) and the OpenAI
server. Each case must get an error naming the field (Triton: INVALID_ARG, which HTTP shows as 400 and a gRPC stream
as the message alone; the OpenAI server: 400 or 413 with a JSON error),
then the next valid request must succeed and the KV gauges must be back at their baseline."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.metrics import scrape
from scripts import tritonserver as triton_server
from tests.helpers import collect, post
from tests.helpers import start_openai as start

GOOD = '{"max_tokens": 2, "temperature": 0}'

# id, inputs ({name: value}; str -> BYTES, list -> INT32 unless an ndarray), the field the error must name
TRITON_CASES = [
    ("no-prompt", {"sampling_parameters": GOOD}, "text_input"),
    ("text-and-ids", {"text_input": "hi", "input_ids": [5, 6]}, "text_input"),
    ("empty-text", {"text_input": ""}, "text_input"),
    ("empty-ids", {"input_ids": np.zeros(0, dtype=np.int32)}, "input_ids"),
    ("prompt-past-context", {"input_ids": [5] * 4100}, "input_ids"),
    ("invalid-utf8", {"text_input": b"ab\xff\xfe"}, "text_input"),
    ("params-not-json", {"text_input": "hi", "sampling_parameters": "{max_tokens: 2"}, "sampling_parameters"),
    ("params-not-object", {"text_input": "hi", "sampling_parameters": "[1, 2]"}, "sampling_parameters"),
    ("params-unknown-key", {"text_input": "hi", "sampling_parameters": '{"max_tokenz": 2}'}, "max_tokenz"),
    ("max-tokens-not-number", {"text_input": "hi", "sampling_parameters": '{"max_tokens": "abc"}'}, "max_tokens"),
    ("temperature-a-list", {"text_input": "hi", "sampling_parameters": '{"temperature": [1]}'}, "temperature"),
    ("max-tokens-zero", {"text_input": "hi", "sampling_parameters": '{"max_tokens": 0}'}, "max_tokens"),
    ("max-tokens-past-context", {"text_input": "hi", "sampling_parameters": '{"max_tokens": 5000}'}, "max_tokens"),
    ("temperature-negative", {"text_input": "hi", "sampling_parameters": '{"temperature": -0.5}'}, "temperature"),
    ("top-p-zero", {"text_input": "hi", "sampling_parameters": '{"top_p": 0}'}, "top_p"),
    ("top-p-above-one", {"text_input": "hi", "sampling_parameters": '{"top_p": 1.5}'}, "top_p"),
    ("top-k-below-minus-one", {"text_input": "hi", "sampling_parameters": '{"top_k": -2}'}, "top_k"),
    ("seed-negative", {"text_input": "hi", "sampling_parameters": '{"seed": -1}'}, "seed"),
    ("seed-not-integer", {"text_input": "hi", "sampling_parameters": '{"seed": 1.5}'}, "seed"),
    ("stop-a-number", {"text_input": "hi", "sampling_parameters": '{"stop": 5}'}, "stop"),
    ("stop-list-of-numbers", {"text_input": "hi", "sampling_parameters": '{"stop": [1, 2]}'}, "stop"),
    ("min-tokens-above-max", {"text_input": "hi", "sampling_parameters": '{"min_tokens": 9, "max_tokens": 3}'},
     "min_tokens"),
    ("ignore-eos-not-bool", {"text_input": "hi", "sampling_parameters": '{"ignore_eos": "maybe"}'}, "ignore_eos"),
    ("logprobs-too-many", {"text_input": "hi", "sampling_parameters": '{"logprobs": 21}'}, "logprobs"),
    ("n-zero", {"text_input": "hi", "sampling_parameters": '{"n": 0}'}, "n"),
    ("n-past-the-batch", {"text_input": "hi", "sampling_parameters": '{"n": 99}'}, "n"),
    ("prompt-logprobs-no-output", {"text_input": "hi", "sampling_parameters": '{"prompt_logprobs": 1}'},
     "prompt_logprobs"),
    ("structured-outputs-bad-regex", {"text_input": "hi", "sampling_parameters":
                                      '{"structured_outputs": "{\\"regex\\": \\"(\\"}"}'}, "structured_outputs.regex"),
    ("cache-salt-not-string", {"text_input": "hi", "sampling_parameters": '{"cache_salt": 5}'}, "cache_salt"),
    ("cache-salt-too-long", {"text_input": "hi", "sampling_parameters": '{"cache_salt": "%s"}' % ("x" * 300)},
     "cache_salt"),
    ("params-lora-name", {"text_input": "hi", "sampling_parameters": '{"lora_name": "adapter"}'}, "lora_name"),
    ("penalty-out-of-range", {"text_input": "hi", "sampling_parameters": '{"presence_penalty": 9}'},
     "presence_penalty"),
    ("logit-bias-not-ids", {"text_input": "hi", "sampling_parameters": '{"logit_bias": {"x": 1}}'}, "logit_bias"),
    ("logprobs-negative", {"text_input": "hi", "sampling_parameters": '{"logprobs": -1}'}, "logprobs"),
    ("ids-outside-vocab", {"input_ids": [5, 99999]}, "input_ids"),
    ("ids-negative", {"input_ids": [5, -3]}, "input_ids"),
    ("ids-wrong-dtype", {"input_ids": np.array([5, 6], dtype=np.int64)}, "input_ids"),
    ("ids-wrong-rank", {"input_ids": np.array([[5, 6]], dtype=np.int32)}, "input_ids"),
    ("stream-echoing-input", {"text_input": "hi", "stream": True, "exclude_input_in_output": False},
     "exclude_input_in_output"),
]


def tensors(inputs: dict) -> list:
    out = []
    for name, value in inputs.items():
        if isinstance(value, bool):
            arr, dtype = np.array([value]), "BOOL"
        elif isinstance(value, (str, bytes)):
            arr, dtype = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES"
        else:
            arr = value if isinstance(value, np.ndarray) else np.array(value, dtype=np.int32)
            dtype = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}[arr.dtype]
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


@pytest.fixture(scope="module")
def triton(tiny_dir, tmp_path_factory):
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32"},
                               tmp_path_factory.mktemp("bad-triton") / "server.log")
    yield srv
    assert srv.stop(timeout=60) == 0


def blocks_used(url: str) -> float:
    return scrape(url, "pagoda_kv_blocks", state="used")


@pytest.mark.parametrize("inputs,field", [pytest.param(i, f, id=n) for n, i, f in TRITON_CASES])
def test_triton_grpc_rejects_and_keeps_serving(triton, inputs, field):
    baseline = blocks_used(triton.metrics_url)
    responses, error = collect(triton, tensors({"stream": True, **inputs}))
    assert error is not None and not responses
    assert str(error).startswith(field) or f"'{field}'" in str(error), error   # a streamed error carries no code
    responses, error = collect(triton, tensors({"text_input": "hello", "stream": True,
                                                            "sampling_parameters": GOOD}))
    assert error is None and sum("output_ids" in r for r in responses) == 2 and responses[-1]["final"]
    assert blocks_used(triton.metrics_url) == baseline


HTTP_CASES = [c for c in TRITON_CASES if all(isinstance(v, (str, bool)) for v in c[1].values())]


@pytest.mark.parametrize("inputs,field", [pytest.param(i, f, id=n) for n, i, f in HTTP_CASES])
def test_triton_http_generate_rejects_and_keeps_serving(triton, inputs, field):
    baseline = blocks_used(triton.metrics_url)
    status, body = post(triton.http_url, "/v2/models/llm/generate", inputs)
    assert status == 400 and field in body["error"], body
    status, body = post(triton.http_url, "/v2/models/llm/generate",
                        {"text_input": "hello", "sampling_parameters": GOOD})
    assert status == 200 and body["text_output"]
    assert blocks_used(triton.metrics_url) == baseline


OPENAI_CASES = [
    ("malformed-json", b'{"model": "tiny0", "prompt": ', "body", 400),
    ("wrong-model", {"model": "gpt-4", "prompt": "hi"}, "model", 400),
    ("no-prompt", {"model": "tiny0"}, "prompt", 400),
    ("empty-prompt", {"model": "tiny0", "prompt": ""}, "prompt", 400),
    ("prompt-past-context", {"model": "tiny0", "prompt": [5] * 4100}, "input_ids", 400),
    ("ids-outside-vocab", {"model": "tiny0", "prompt": [5, 99999]}, "input_ids", 400),
    ("max-tokens-not-number", {"model": "tiny0", "prompt": "hi", "max_tokens": "abc"}, "max_tokens", 400),
    ("max-tokens-zero", {"model": "tiny0", "prompt": "hi", "max_tokens": 0}, "max_tokens", 400),
    ("temperature-negative", {"model": "tiny0", "prompt": "hi", "temperature": -1}, "temperature", 400),
    ("top-p-above-one", {"model": "tiny0", "prompt": "hi", "top_p": 1.5}, "top_p", 400),
    ("seed-negative", {"model": "tiny0", "prompt": "hi", "seed": -4}, "seed", 400),
    ("stop-a-number", {"model": "tiny0", "prompt": "hi", "stop": 5}, "stop", 400),
    ("known-not-honoured", {"model": "tiny0", "prompt": "hi", "best_of": 3}, "best_of", 400),
    ("penalty-out-of-range", {"model": "tiny0", "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", 400),
    ("body-too-large", {"model": "tiny0", "prompt": "x" * 70_000}, "body", 413),
]
CHAT_CASES = [
    ("messages-a-string", {"model": "tiny0", "messages": "hello"}, "messages", 400),
    ("message-not-an-object", {"model": "tiny0", "messages": ["hello"]}, "messages", 400),
    ("message-without-role", {"model": "tiny0", "messages": [{"content": "hi"}]}, "messages", 400),
]


@pytest.fixture(scope="module")
def openai(tiny_dir, tmp_path_factory):
    proc, url = start(tiny_dir, tmp_path_factory.mktemp("bad-openai") / "server.log", "--max-body-bytes", "65536")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.mark.parametrize("path,body,field,status", [
    *[pytest.param("/v1/completions", b, f, s, id=n) for n, b, f, s in OPENAI_CASES],
    *[pytest.param("/v1/chat/completions", b, f, s, id=n) for n, b, f, s in CHAT_CASES]])
def test_openai_rejects_and_keeps_serving(openai, path, body, field, status):
    metrics = f"http://{openai}/metrics"
    baseline = blocks_used(metrics)
    got, out = post(openai, path, body)
    assert got == status and out["error"]["param"].split(".")[0] == field and field in out["error"]["message"], out
    got, out = post(openai, "/v1/completions", {"model": "tiny0", "prompt": "hello", "max_tokens": 2})
    assert got == 200 and out["usage"]["completion_tokens"] == 2
    assert blocks_used(metrics) == baseline


def test_chunked_body_past_the_limit_is_refused(openai):
    import http.client
    host, port = openai.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": "tiny0", "prompt": "y" * 70_000}).encode()
    conn.request("POST", "/v1/completions", body=iter([body[:40_000], body[40_000:]]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["param"] == "body"
    conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)      # under the limit, chunked: served
    body = json.dumps({"model": "tiny0", "prompt": "hello", "max_tokens": 2}).encode()
    conn.request("POST", "/v1/completions", body=iter([body[:10], body[10:]]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
    conn.close()


def test_a_model_directory_without_config_json_is_named(tmp_path):
    from engine.config import EngineConfig
    from engine.core.engine import Engine
    with pytest.raises(ValueError, match=f"model: {tmp_path} has no config.json"):
        Engine(EngineConfig(model=str(tmp_path)))
