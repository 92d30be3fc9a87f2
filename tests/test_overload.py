"""Overload is an answer: a burst of far more concurrent requests than the queue holds (max_queue 4, two decoding),
a third hung up mid-stream and some malformed, against the OpenAI server and through the Triton model over gRPC.
Every request ends completed, refused before any token (429 with Retry-After; UNAVAILABLE), hung up, or as a 4xx
naming the bad field; afterwards nothing is held and greedy output is what it was."""
from __future__ import annotations

import http.client
import json
import signal

import pytest
import tritonclient.grpc as grpcclient

from client.flood import burst_grpc, burst_openai
from client.metrics import scrape
from client.stream import grpc_inputs, stream_grpc
from engine import LLM, SamplingParams
from scripts import tritonserver as triton_server
from tests.helpers import post, random_ids, stop_checked, triton_post, wait_until
from tests.helpers import start_openai as start

LIMITS = ["--max-batch-size", "2", "--max-queue", "4", "--num-kv-blocks", "40"]       # 40 blocks: 1280 tokens
PROMPTS = [random_ids(40, seed=100 + i) for i in range(36)]


def idle(metrics_url: str) -> bool:
    return all(scrape(metrics_url, name, **labels) == 0 for name, labels in [
        ("pagoda_kv_blocks", {"state": "used"}), ("pagoda_batch_size", {}), ("pagoda_queue_depth", {})])


def check(endings, n: int) -> None:
    assert not [e for e in endings if e.startswith("unexpected")], endings
    assert sum(endings.values()) == n
    assert endings["refused"] > 0 and endings["completed"] >= 4, endings     # the queue filled, and it drained
    assert endings["malformed"] == n // 8 and endings["disconnected"] > 0, endings


def test_openai_burst(tiny_dir, tmp_path):
    proc, url = start(tiny_dir, tmp_path / "server.log", *LIMITS)
    try:
        endings = burst_openai(url, "tiny0", PROMPTS, max_tokens=48)
        check(endings, len(PROMPTS))
        wait_until(lambda: idle(f"http://{url}/metrics"), "nothing held after the burst")
        status, out = post(url, "/v1/completions", {"model": "tiny0", "prompt": PROMPTS[0], "max_tokens": 8,
                                                    "temperature": 0, "ignore_eos": True})
        want = LLM(model=tiny_dir, dtype="float32").generate(PROMPTS[0], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids
        # a prompt the whole pool cannot hold is refused at submit, naming it, not queued to fail later
        status, out = post(url, "/v1/completions", {"model": "tiny0", "prompt": random_ids(1400, seed=5),
                                                    "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "input_ids" and "KV blocks" in out["error"]["message"]
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM)


@pytest.mark.parametrize("stream", [True, False])
def test_an_error_after_the_200_is_an_error_event_then_done(tiny_dir, tmp_path, monkeypatch, stream):
    """A request that fails after its 200 (a failed engine step, by failpoint) gets an OpenAI-shaped error event
    and then [DONE], as vLLM ends it; not streamed, a 500 with the same error."""
    monkeypatch.setenv("PAGODA_FAILPOINT_STEPS", "3")
    proc, url = start(tiny_dir, tmp_path / "server.log")
    try:
        host, port = url.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny0", "prompt": PROMPTS[1], "stream": stream,
                                                            "max_tokens": 40, "ignore_eos": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        if stream:
            events = [line for line in body.splitlines() if line.startswith(b"data:")]
            error = json.loads(events[-2][5:])["error"]
            assert resp.status == 200 and events[-1] == b"data: [DONE]"
        else:
            error = json.loads(body)["error"]
            assert resp.status == 500
        assert error["type"] == "server_error" and error["code"] == 500 and "failpoint" in error["message"]
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM)


def test_triton_grpc_burst(tiny_dir, tmp_path):
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32", "PAGODA_MAX_BATCH_SIZE": "2",
                                "PAGODA_MAX_QUEUE": "4"}, tmp_path / "server.log")
    try:
        endings = burst_grpc(srv.grpc_url, "llm", PROMPTS, max_tokens=48)
        check(endings, len(PROMPTS))
        wait_until(lambda: idle(srv.metrics_url), "nothing held after the burst")
        want = LLM(model=tiny_dir, dtype="float32").generate(PROMPTS[0], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))[0]
        got = stream_grpc(srv.grpc_url, "llm", PROMPTS[0], {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert got.error is None and got.ids == want.token_ids
        # a full queue over HTTP generate: tritonserver 2.51 answers any error a decoupled model sends with 400 (its
        # code is dropped there, as a gRPC stream carries only the message): the message names the limit and the wait
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        client.start_stream(callback=lambda result, error: None)
        try:
            for i in range(6):                  # two decoding, then four waiting
                client.async_stream_infer("llm", grpc_inputs(PROMPTS[i], {"max_tokens": 3000, "ignore_eos": True}))
                if i == 1:
                    wait_until(lambda: scrape(srv.metrics_url, "pagoda_batch_size") == 2, "two decoding")
            wait_until(lambda: scrape(srv.metrics_url, "pagoda_queue_depth") == 4, "the queue to fill")
            status, body = triton_post(srv, "/v2/models/llm/generate", {"text_input": "hi"})
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()
        assert status == 400 and "max_queue" in json.loads(body)["error"] and "retry after" in body.decode(), body
        wait_until(lambda: idle(srv.metrics_url), "nothing held after the cancels")
    finally:
        stop_checked(srv)
