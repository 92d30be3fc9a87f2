"""Cancellation at each stage, KV pressure, an injected step failure, shutdown with requests in flight, and logs
that never hold prompt text: through a real tritonserver (gRPC) and the OpenAI server."""
from __future__ import annotations

import http.client
import json
import shutil
import signal
import threading
import time

import pytest
import tritonclient.grpc as grpcclient

from client.metrics import scrape
from client.stream import grpc_inputs, stream_grpc
from engine import LLM, SamplingParams
from scripts import tritonserver as triton_server
from tests.helpers import collect, random_ids, stop_checked, wait_until
from tests.helpers import start_openai as start

SECRET = "zebra quartz lantern"          # prompt text that must never reach a log
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def triton(tiny_dir, tmp_path_factory):
    """Two rows at a time over a 40-block pool (1280 tokens): queues and preemption happen."""
    log = tmp_path_factory.mktemp("reliability") / "server.log"
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32", "PAGODA_MAX_BATCH_SIZE": "2",
                                "PAGODA_NUM_KV_BLOCKS": "40"}, log)
    yield srv
    stop_checked(srv)


@pytest.fixture(scope="module")
def roomy(tiny_dir, tmp_path_factory):
    """Two rows over a 64k-token context: a request asked for 60000 tokens holds its row until it is cancelled,
    whatever the decode speed, so a third request stays queued for as long as a test needs."""
    base = tmp_path_factory.mktemp("roomy")
    model = shutil.copytree(tiny_dir, base / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    srv = triton_server.launch({"PAGODA_MODEL": str(model), "PAGODA_DTYPE": "float32", "PAGODA_MAX_BATCH_SIZE": "2",
                                "PAGODA_NUM_KV_BLOCKS": "4096"}, base / "server.log")
    yield srv
    stop_checked(srv)


class Held:
    """A streamed request that runs until the test cancels it."""

    def __init__(self, srv, prompt: list[int], max_tokens: int = 60000) -> None:
        self.responses = 0
        self.started = threading.Event()
        self.client = grpcclient.InferenceServerClient(srv.grpc_url)
        self.client.start_stream(callback=self._on_response)
        self.client.async_stream_infer("llm", grpc_inputs(prompt, {**GREEDY, "max_tokens": max_tokens}),
                                       enable_empty_final_response=True)

    def _on_response(self, result, error) -> None:
        if error is None:
            self.responses += 1
            self.started.set()

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def value(srv, name: str, **labels: str) -> float:
    return scrape(srv.metrics_url, name, **labels)


def settle(srv, used: float, cancelled: float | None = None, timeout: float = 20) -> None:
    """Wait until the used-block gauge is back to `used` (and the cancelled counter reaches `cancelled`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value(srv, "pagoda_kv_blocks", state="used") == used and (
                cancelled is None or value(srv, "pagoda_requests_total", status="cancelled") >= cancelled):
            return
        time.sleep(0.1)
    raise AssertionError(f"not settled: used {value(srv, 'pagoda_kv_blocks', state='used')} (want {used}), "
                         f"cancelled {value(srv, 'pagoda_requests_total', status='cancelled')} (want {cancelled})")


def long_request(seed: int, max_tokens: int = 300) -> list:
    return grpc_inputs(random_ids(60, seed=seed), {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


@pytest.mark.parametrize("stage", ["queued", "first-token", "mid-decode", "last-token"])
def test_cancel_at_each_stage_returns_every_block(roomy, stage):
    probe = random_ids(40, seed=77)
    reference = stream_grpc(roomy.grpc_url, "llm", probe, GREEDY).ids
    used = value(roomy, "pagoda_kv_blocks", state="used")
    cancelled = value(roomy, "pagoda_requests_total", status="cancelled")
    if stage == "queued":                    # both rows busy: the cancelled request never leaves the queue
        blockers = [Held(roomy, random_ids(60, seed=s)) for s in (1, 2)]
        assert all(b.started.wait(60) for b in blockers)
        victim = Held(roomy, random_ids(50, seed=5), max_tokens=400)
        wait_until(lambda: value(roomy, "pagoda_queue_depth") >= 1, "the request to queue")
        victim.cancel()
        wait_until(lambda: value(roomy, "pagoda_requests_total", status="cancelled") >= cancelled + 1,
                   "the queued request to end as cancelled")
        assert victim.responses == 0
        for b in blockers:
            b.cancel()
        cancelled += 2
    else:
        after = {"first-token": 1, "mid-decode": 6, "last-token": 11}[stage]
        params = GREEDY if stage == "last-token" else {**GREEDY, "max_tokens": 60000}
        responses, error = collect(roomy, grpc_inputs(random_ids(50, seed=5), params), cancel_after=after)
        assert error is None and len(responses) == after
    raced = stage == "last-token"            # the last token may already be on its way: completed or cancelled
    settle(roomy, used, None if raced else cancelled + 1)
    assert stream_grpc(roomy.grpc_url, "llm", probe, GREEDY).ids == reference


def test_grpc_channel_closed_abruptly(triton):
    """Triton 2.51 does not report a stream whose channel just closed as cancelled: the request runs to its end,
    then every block returns and the server serves on."""
    used = value(triton, "pagoda_kv_blocks", state="used")
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    got = threading.Event()
    client.start_stream(callback=lambda result, error: got.set())
    client.async_stream_infer("llm", long_request(8, 300), enable_empty_final_response=True)
    assert got.wait(30)
    client.close()                           # no stop_stream: the connection just goes away
    settle(triton, used, timeout=60)
    assert stream_grpc(triton.grpc_url, "llm", "hello", GREEDY).error is None


def test_request_larger_than_the_pool_fails_fast(triton):
    started = time.monotonic()
    responses, error = collect(triton, grpc_inputs(random_ids(1400, seed=3), GREEDY))
    assert error is not None and "input_ids" in str(error) and "KV blocks" in str(error)
    assert time.monotonic() - started < 5
    assert stream_grpc(triton.grpc_url, "llm", "hello", GREEDY).error is None


def test_more_work_than_blocks_finishes_with_the_tokens_each_gets_alone(triton, tiny_dir):
    """Six 700-token requests over two rows and 40 blocks (two need 44): they queue and preempt, then match
    offline greedy."""
    prompts = [random_ids(350, seed=30 + i) for i in range(6)]
    params = {"max_tokens": 350, "temperature": 0, "ignore_eos": True}
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = stream_grpc(triton.grpc_url, "llm", prompts[i], params)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    llm = LLM(model=tiny_dir, dtype="float32", max_batch_size=1)
    for prompt, result in zip(prompts, results):
        assert result.error is None and result.finish_reason == "length"
        alone = llm.generate(prompt, SamplingParams(**params))[0]
        assert result.ids == alone.token_ids
    assert value(triton, "pagoda_preemptions_total") > 0
    settle(triton, 0)


def test_logs_never_hold_prompt_text(triton):
    assert stream_grpc(triton.grpc_url, "llm", SECRET, GREEDY).error is None
    collect(triton, grpc_inputs(SECRET, {"max_tokens": -3}))            # rejected: the error names a field only
    time.sleep(0.5)
    log = triton.log.read_text(encoding="utf-8", errors="replace")
    assert "request completed" in log and SECRET not in log


def test_a_failed_step_ends_requests_with_an_error_and_the_engine_recovers(tiny_dir, tmp_path):
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32",
                                "PAGODA_FAILPOINT_STEPS": "4"}, tmp_path / "server.log")
    try:
        responses, error = collect(srv, grpc_inputs(random_ids(30, seed=1), GREEDY))
        assert error is not None and "failpoint" in str(error)
        assert stream_grpc(srv.grpc_url, "llm", random_ids(30, seed=1), GREEDY).ids
        assert value(srv, "pagoda_requests_total", status="error") == 1
        settle(srv, 0)
    finally:
        stop_checked(srv)


def test_openai_shutdown_with_a_stream_in_flight(tiny_dir, tmp_path):
    proc, url = start(tiny_dir, tmp_path / "server.log")
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny0", "prompt": SECRET, "max_tokens": 3000,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    assert first.startswith(b"data:")
    proc.terminate()
    started = time.monotonic()
    try:
        rest = resp.read()            # the stream drains within the 5 s grace, or ends with an error or a cut
    except http.client.IncompleteRead as e:
        rest = e.partial
    assert time.monotonic() - started < 20
    if b"[DONE]" in rest and b"error" not in rest:          # drained: then every token was sent, none dropped
        events = [json.loads(line[5:]) for line in (first + rest).splitlines()
                  if line.startswith(b"data: {")]
        assert sum(len(c["token_ids"]) for e in events for c in e["choices"]) == 3000
    assert proc.wait(30) in (0, -signal.SIGTERM)
    assert SECRET not in (tmp_path / "server.log").read_text()


def test_triton_shutdown_with_a_stream_in_flight(tiny_dir, tmp_path):
    """tritonserver drains in-flight requests on SIGTERM (up to its exit timeout): the stream ends with its FINAL
    response, then the server unloads the model and exits cleanly."""
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32"}, tmp_path / "server.log")
    done: dict = {}

    def run() -> None:
        done["responses"], done["error"] = collect(srv, long_request(4, 600))
    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    started = time.monotonic()
    assert srv.stop(timeout=60) == 0
    t.join(30)
    assert time.monotonic() - started < 35
    assert done["error"] is None and done["responses"][-1]["final"] and len(done["responses"]) == 600


def test_requests_cancelled_while_queued_return_their_blocks(roomy):
    """Six requests cancelled while they wait behind two busy rows: each ends as cancelled and every block
    returns."""
    used = value(roomy, "pagoda_kv_blocks", state="used")
    cancelled = value(roomy, "pagoda_requests_total", status="cancelled")
    blockers = [Held(roomy, random_ids(60, seed=s)) for s in (11, 12)]
    assert all(b.started.wait(60) for b in blockers)
    queued = [Held(roomy, random_ids(30, seed=60 + i), max_tokens=12) for i in range(6)]
    wait_until(lambda: value(roomy, "pagoda_queue_depth") >= 6, "six requests to queue")
    for q in queued:
        q.cancel()
    wait_until(lambda: value(roomy, "pagoda_requests_total", status="cancelled") >= cancelled + 6,
               "the six queued requests to end as cancelled")
    assert all(q.responses == 0 for q in queued)
    for b in blockers:
        b.cancel()
    settle(roomy, used, cancelled + 8)
