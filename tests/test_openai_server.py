"""The OpenAI-compatible server over real HTTP (uvicorn on a loopback port)."""
from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from client.metrics import scrape
from client.stream import stream_openai
from engine import LLM, SamplingParams
from tests.helpers import missing_series, post, random_ids, wait_until
from tests.helpers import start_openai as start

PROMPT = random_ids(70, seed=11)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("openai") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_dir, server_log):
    proc, url = start(tiny_dir, server_log)
    yield url
    proc.terminate()
    assert proc.wait(30) in (0, -signal.SIGTERM)     # uvicorn re-raises SIGTERM after its graceful shutdown


def metric(url: str, name: str, **labels: str) -> float:
    return scrape(f"http://{url}/metrics", name, **labels)


def drop_mid_stream(url: str, events: int) -> None:
    """Open a long streamed completion, read `events` SSE events, then hang up."""
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny0", "prompt": random_ids(90, seed=4),
                                                        "max_tokens": 2000, "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    seen = 0
    while seen < events:
        seen += resp.readline().startswith(b"data:")
    resp.close()
    conn.close()


def wait_cancelled(url: str, count: float) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric(url, "pagoda_requests_total", status="cancelled") < count:
        time.sleep(0.1)


def test_every_series_exists_before_any_request(server):
    """First in this module: nothing served yet, and every pagoda_* series is there."""
    assert missing_series(f"http://{server}/metrics") == []
    assert metric(server, "pagoda_kv_blocks", state="free") > 0
    assert metric(server, "pagoda_requests_total", status="completed") == 0


def test_completions_match_offline_and_report_cached_tokens(server, tiny_dir):
    expected = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    status, out = post(server, "/v1/completions", {"model": "tiny0", "prompt": PROMPT, "max_tokens": 8,
                                                   "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == expected.token_ids and out["choices"][0]["text"] == expected.text
    assert out["usage"]["prompt_tokens"] == 70 and out["usage"]["completion_tokens"] == 8
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, again = post(server, "/v1/completions", {"model": "tiny0", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    r = stream_openai(server, "tiny0", PROMPT, {"max_tokens": 8, "temperature": 0})
    assert r.ids == expected.token_ids and r.text == expected.text and r.finish_reason == "length"
    assert r.cached_tokens == 64 and r.num_input_tokens == 70


def test_chat_completions(server):
    body = {"model": "tiny0", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5,
            "temperature": 0}
    status, out = post(server, "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant" and len(out["choices"][0]["token_ids"]) == 5
    req = urllib.request.Request(f"http://{server}/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({**body, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode())
    lines = [line for line in urllib.request.urlopen(req).read().decode().splitlines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == out["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []


def test_unknown_fields_are_ignored_with_one_log_line(server, server_log):
    """As vLLM's server: routers and SDKs add fields (vllm-router sends no_stop_trim); a known field whose value
    asks for nothing is accepted too. Each set of ignored names is logged once, not once per request."""
    body = {"model": "tiny0", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    _, plain = post(server, "/v1/completions", body)
    status, out = post(server, "/v1/completions", {**body, "no_stop_trim": True, "zz_extra": {"a": 1},
                                                   "presence_penalty": 0, "logprobs": None})
    assert status == 200 and out["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    wait_until(lambda: "ignored fields the server does not know: no_stop_trim, zz_extra" in server_log.read_text(),
               "the log line naming the ignored fields")
    post(server, "/v1/completions", {**body, "no_stop_trim": True, "zz_extra": 2})
    post(server, "/v1/completions", {**body, "zz_other": 1})
    wait_until(lambda: "does not know: zz_other" in server_log.read_text(), "the line for another set of fields")
    assert server_log.read_text().count("does not know: no_stop_trim, zz_extra") == 1


def test_echo_prepends_the_prompt(server):
    body = {"model": "tiny0", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    _, plain = post(server, "/v1/completions", body)
    _, echoed = post(server, "/v1/completions", {**body, "echo": True})
    assert echoed["choices"][0]["text"] == "hello there" + plain["choices"][0]["text"]
    r = stream_openai(server, "tiny0", "hello there", {"max_tokens": 4, "temperature": 0, "echo": True})
    assert r.text == echoed["choices"][0]["text"]


def test_models_health_metrics(server):
    models = json.loads(urllib.request.urlopen(f"http://{server}/v1/models").read())
    assert [m["id"] for m in models["data"]] == ["tiny0"]
    assert metric(server, "pagoda_requests_total", status="completed") >= 1
    assert metric(server, "pagoda_kv_blocks", state="free") > 0


@pytest.mark.parametrize("body,field", [
    ({"model": "nope", "prompt": "hi"}, "model"),
    ({"model": "tiny0", "prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ({"model": "tiny0", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "tiny0", "prompt": ""}, "prompt"),
    ({"model": "tiny0", "prompt": [1, 99999]}, "input_ids"),
    ({"model": "tiny0"}, "prompt"),
    ({"model": "tiny0", "prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"model": "tiny0", "prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"model": "tiny0", "prompt": "hi", "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"model": "tiny0", "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": "tiny0", "prompt": "hi", "cache_salt": 5}, "cache_salt"),
    ({"model": "tiny0", "prompt": "hi", "cache_salt": "x" * 300}, "cache_salt"),
    ({"model": "tiny0", "prompt": "hi", "logprobs": 21}, "logprobs"),
])
def test_bad_requests_are_400_naming_the_field(server, body, field):
    status, out = post(server, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == field, out
    status, out = post(server, "/v1/chat/completions", {"model": "tiny0", "messages": "nope"})
    assert status == 400 and out["error"]["param"] == "messages"
    status, out = post(server, "/v1/completions", b"{not json")
    assert status == 400


def test_disconnect_mid_stream_frees_blocks(server):
    cancelled = metric(server, "pagoda_requests_total", status="cancelled")
    drop_mid_stream(server, events=5)
    wait_cancelled(server, cancelled + 1)
    assert metric(server, "pagoda_requests_total", status="cancelled") == cancelled + 1
    assert metric(server, "pagoda_kv_blocks", state="used") == 0
    assert post(server, "/v1/completions", {"model": "tiny0", "prompt": "still here", "max_tokens": 2})[0] == 200


def test_bench_client_openai_protocol(server, tmp_path):
    from perf import bench_serving as bench
    report = bench.main(["--protocol", "openai", "--url", server, "--model", "tiny0", "--prompt-tokens", "80",
                         "--max-tokens", "6", "--pairs", "1", "--json", str(tmp_path / "o.json")])
    row = report["summary"][1]
    assert row["miss"]["cached"] == 0 and row["hit"]["cached"] == 32 and row["hit"]["lookahead_steps"] == 4


def test_api_key(tiny_dir, tmp_path):
    proc, url = start(tiny_dir, tmp_path / "log.txt", "--api-key", "s3cret")
    try:
        body = {"model": "tiny0", "prompt": "hi", "max_tokens": 2}
        status, out = post(url, "/v1/completions", body)
        assert status == 401 and out["error"]["param"] == "authorization"
        assert post(url, "/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        assert urllib.request.urlopen(f"http://{url}/health").status == 200       # health stays open
    finally:
        proc.terminate()
        proc.wait(30)


def test_mlx_runner_behind_the_server(tiny_dir, tmp_path):
    """The Apple path: `serve --runner mlx`, streamed and whole completions, cached tokens, disconnect frees KV."""
    pytest.importorskip("mlx.core")
    proc, url = start(tiny_dir, tmp_path / "log.txt", "--runner", "mlx")
    try:
        expected = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))
        status, out = post(url, "/v1/completions", {"model": "tiny0", "prompt": PROMPT, "max_tokens": 6,
                                                    "temperature": 0})
        assert status == 200 and out["choices"][0]["token_ids"] == expected[0].token_ids
        r = stream_openai(url, "tiny0", PROMPT, {"max_tokens": 6, "temperature": 0})
        assert r.ids == expected[0].token_ids and r.cached_tokens == 64
        drop_mid_stream(url, events=3)
        wait_cancelled(url, 1)
        assert metric(url, "pagoda_requests_total", status="cancelled") == 1
        assert metric(url, "pagoda_kv_blocks", state="used") == 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_engine_thread_behind_the_server(tiny_dir, tmp_path):
    """`serve --engine-process false`: the step loop on a thread of the server (the other tests run the default, a
    child process); chat templating, streamed completions, cached tokens, metrics and a disconnect that frees the
    KV all work the same."""
    proc, url = start(tiny_dir, tmp_path / "log.txt", "--engine-process", "false")
    try:
        expected = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))
        r = stream_openai(url, "tiny0", PROMPT, {"max_tokens": 6, "temperature": 0})
        assert r.ids == expected[0].token_ids
        r = stream_openai(url, "tiny0", PROMPT, {"max_tokens": 6, "temperature": 0})
        assert r.ids == expected[0].token_ids and r.cached_tokens == 64
        status, out = post(url, "/v1/chat/completions", {"model": "tiny0", "max_tokens": 4, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hello"}]})
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 4
        assert metric(url, "pagoda_requests_total", status="completed") == 3
        drop_mid_stream(url, events=3)
        wait_cancelled(url, 1)
        assert metric(url, "pagoda_kv_blocks", state="used") == 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_render_gives_the_prompts_token_ids_as_vllm_does(server):
    """vLLM's /v1/completions/render (a list, one per prompt) and /v1/chat/completions/render (one): the ids the
    server would run, nothing generated. Cache-aware routers match requests against replicas' blocks with them."""
    ids = random_ids(30, seed=7)
    status, out = post(server, "/v1/completions/render", {"model": "tiny0", "prompt": ids, "temperature": 0.5})
    assert status == 200 and isinstance(out, list) and len(out) == 1
    assert out[0]["token_ids"] == ids and out[0]["model"] == "tiny0" and out[0]["request_id"].startswith("cmpl-")
    assert out[0]["sampling_params"]["temperature"] == 0.5
    status, text = post(server, "/v1/completions/render", {"model": "tiny0", "prompt": "the cat sat on the mat"})
    _, done = post(server, "/v1/completions", {"model": "tiny0", "prompt": "the cat sat on the mat", "max_tokens": 1})
    assert status == 200 and len(text[0]["token_ids"]) == done["usage"]["prompt_tokens"]
    messages = [{"role": "user", "content": "hello there"}]
    status, chat = post(server, "/v1/chat/completions/render", {"model": "tiny0", "messages": messages})
    _, answered = post(server, "/v1/chat/completions", {"model": "tiny0", "messages": messages, "max_tokens": 1})
    assert status == 200 and isinstance(chat, dict)
    assert len(chat["token_ids"]) == answered["usage"]["prompt_tokens"]
    status, wrong = post(server, "/v1/completions/render", {"model": "other", "prompt": ids})
    assert status == 404 and "model" in wrong["error"]["message"]
