"""A model repository laid out as vllm_backend's sample (samples/model_repository/vllm_model: a config.pbtxt naming
the backend and KIND_MODEL, and 1/model.json of vLLM engine arguments), with `backend: "vllm"` swapped for ours and
our model.py beside model.json, served by a real tritonserver; then the examples of vllm_backend's README and the
request shape of its sample gRPC client, with vllm_backend's semantics."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np
import pytest

from engine import LLM, SamplingParams
from scripts import tritonserver as triton_server
from tests.helpers import stop_checked, triton_post

QUESTION = "What is Triton Inference Server?"
# vllm_backend's samples/prompts.txt
PROMPTS = ["Hello, my name is\n", "The most dangerous animal is\n", "The capital of France is\n",
           "The future of AI is\n"]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("vllm-layout")
    model = repo / "vllm_model"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\n\ninstance_group [\n  {\n    count: 1\n'
                                        '    kind: KIND_MODEL\n  }\n]\n')
    # the sample's model.json, its model swapped for the tiny checkpoint (float32, so offline runs match it)
    (model / "1" / "model.json").write_text(json.dumps({"model": tiny_dir, "gpu_memory_utilization": 0.1,
                                                        "enforce_eager": True, "dtype": "float32"}))
    (model / "1" / "model.py").write_text((triton_server.ROOT / "model_repository/llm/1/model.py").read_text())
    srv = triton_server.launch({}, repo / "server.log", repository=repo)
    yield srv
    stop_checked(srv)


def post(server, path: str, body: dict) -> tuple[int, bytes]:
    return triton_post(server, f"/v2/models/vllm_model/{path}", body)


@pytest.fixture(scope="module")
def greedy(tiny_dir):
    """The offline engine's greedy text of `max_tokens` after a prompt."""
    llm = LLM(model=tiny_dir, dtype="float32")
    return lambda prompt, max_tokens: llm.generate(prompt, SamplingParams(max_tokens=max_tokens,
                                                                          temperature=0))[0].text


def test_the_model_json_arguments_took_effect(server):
    """Every argument of the sample maps onto an option (enforce_eager: no CUDA graphs); on a CPU the memory share
    is said to have no effect, and kv_cache_bytes bounds the pool."""
    log = server.log.read_text()
    assert "model.json: no effect here" not in log
    assert "gpu_memory_utilization has no effect on this device" in log
    config = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2/models/vllm_model/config").read())
    assert config["model_transaction_policy"]["decoupled"] is True


def test_readme_generate_example_is_greedy_and_honours_max_tokens(server, greedy):
    """The README's curl, with max_tokens: the request's parameters are its sampling parameters; not streaming,
    the prompt is prepended (exclude_input_in_output's default)."""
    body = {"text_input": QUESTION, "parameters": {"stream": False, "temperature": 0, "max_tokens": 12}}
    first, second = post(server, "generate", body), post(server, "generate", body)
    assert first[0] == second[0] == 200
    text = json.loads(first[1])["text_output"]
    assert text == json.loads(second[1])["text_output"] == QUESTION + greedy(QUESTION, 12)
    # the README's own example, as written: 16 tokens, vLLM's default max_tokens
    status, out = post(server, "generate", {"text_input": QUESTION, "parameters": {"stream": False,
                                                                                  "temperature": 0}})
    assert status == 200 and json.loads(out)["text_output"] == QUESTION + greedy(QUESTION, 16)


def test_generate_stream_with_parameters(server, greedy):
    status, body = post(server, "generate_stream", {"text_input": QUESTION, "parameters": {
        "stream": True, "temperature": 0, "max_tokens": 5, "return_num_output_tokens": True}})
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith(b"data:")]
    assert status == 200 and len(events) == 5 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == greedy(QUESTION, 5)     # no prompt when streaming
    status, body = post(server, "generate_stream", {"text_input": QUESTION, "exclude_input_in_output": False,
                                                    "parameters": {"stream": True, "max_tokens": 5}})
    assert status == 400 and b"exclude_input_in_output" in body


def test_parameters_are_validated_like_the_tensor(server):
    for params, key in [({"temperature": "hot"}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                        ({"stop_token_ids": "[1, oops]"}, "stop_token_ids"), ({"colour": "blue"}, "colour")]:
        status, body = post(server, "generate", {"text_input": QUESTION, "parameters": params})
        assert status == 400 and key in json.loads(body)["error"], (params, body)
    # the tensor wins when both are sent, as in vllm_backend
    status, body = post(server, "generate", {"text_input": QUESTION, "exclude_input_in_output": True,
                                             "sampling_parameters": json.dumps({"max_tokens": 2, "temperature": 0}),
                                             "parameters": {"max_tokens": 7}})
    assert status == 200 and len(json.loads(body)["output_ids"]) == 2


def test_sample_grpc_client_request_shape(server, greedy):
    """samples/client.py's requests: one gRPC stream of requests with an id each, stream false, exclude false, and
    the sampling parameters both as the tensor and as request parameters (string values); then the same with the
    parameters alone, greedy, and a stop list sent as JSON text."""
    import tritonclient.grpc.aio as grpcclient

    def request(i: int, prompt: str, params: dict, tensor: bool) -> dict:
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
                  grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([False]))
        inputs[2].set_data_from_numpy(np.array([False]))
        if tensor:
            inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
            inputs[-1].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_))
        return {"model_name": "vllm_model", "inputs": inputs, "request_id": str(i), "parameters": params,
                "outputs": [grpcclient.InferRequestedOutput("text_output")]}

    async def run(params: dict, tensor: bool) -> dict[str, list[str]]:
        client = grpcclient.InferenceServerClient(server.grpc_url)

        async def requests():
            for i, prompt in enumerate(PROMPTS):
                yield request(i, prompt, params, tensor)
        out: dict[str, list[str]] = {}
        async for result, error in client.stream_infer(requests(), stream_timeout=120):
            assert error is None, error
            out.setdefault(result.get_response().id, []).extend(
                t.decode() for t in result.as_numpy("text_output"))
            if len(out) == len(PROMPTS) and all(out.values()):
                break
        await client.close()
        return out

    sampled = asyncio.run(run({"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}, tensor=True))
    assert sorted(sampled) == ["0", "1", "2", "3"]
    assert all(len(texts) == 1 and texts[0].startswith(PROMPTS[int(i)]) for i, texts in sampled.items())
    exact = asyncio.run(run({"temperature": 0.0, "max_tokens": 6}, tensor=False))
    assert {i: texts[0] for i, texts in exact.items()} == {
        str(i): p + greedy(p, 6) for i, p in enumerate(PROMPTS)}
    stop = greedy(PROMPTS[0], 6)[2:4]
    stopped = asyncio.run(run({"temperature": 0, "max_tokens": 6, "stop": json.dumps([stop])}, tensor=False))
    assert stopped["0"][0] == PROMPTS[0] + greedy(PROMPTS[0], 6).split(stop)[0]
