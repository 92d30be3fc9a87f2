"""A killed engine process under a real server (SIGKILL, what the OOM killer sends): the stream in flight ends
with an error, requests during the restart are refused UNAVAILABLE / 503 at once, the server serves the same greedy
output again, the restart is counted and no block is held; a second death within the window (restart_limit 2
here) is a crash loop: Triton unloads the model (not ready), the OpenAI server's /health stays 503."""
from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import tritonclient.grpc as grpcclient

from client.metrics import scrape
from client.stream import grpc_inputs
from scripts import tritonserver as triton_server
from scripts.soak import engine_pids
from tests.helpers import collect, post, random_ids, stop_checked, wait_until
from tests.helpers import start_openai as start

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPT = random_ids(40, seed=13)
BACK_WITHIN = 120          # seconds: a restart (a new interpreter, the model loaded again) must be done by then
SUPERVISED = {"PAGODA_RESTART_LIMIT": "2", "PAGODA_RESTART_DELAY_MS": "3000"}   # the wait: time to see the 503s


def engine_pid(log, before: int | None = None) -> int:
    """The engine process's pid, from the log: the latest one that is not `before`."""
    def latest():
        pids = engine_pids(log)
        return pids[-1] if pids and pids[-1] != before else None
    wait_until(lambda: latest() is not None, "the engine's pid in the log", timeout=BACK_WITHIN)
    return latest()


def status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def test_triton_restarts_a_killed_engine_and_unloads_in_a_crash_loop(tiny_dir, tmp_path):
    log = tmp_path / "server.log"
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32", **SUPERVISED}, log)
    try:
        want, error = collect(srv, grpc_inputs(PROMPT, GREEDY))
        assert error is None
        first = engine_pid(log)
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        ended: list = []
        client.start_stream(callback=lambda result, error: ended.append((result, error)))
        client.async_stream_infer("llm", grpc_inputs(PROMPT, {**GREEDY, "max_tokens": 3000}))
        wait_until(lambda: ended, "the first token")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: ended[-1][1] is not None, "the stream in flight to end")
        assert "engine process exited (code -9)" in str(ended[-1][1])
        client.stop_stream()
        # during the 3 s wait before the restart: refused at once, not held until the engine is back (the model
        # answers UNAVAILABLE; tritonserver 2.51's generate endpoint makes any model error a 400)
        code, body = generate(srv, {"text_input": "hi", "sampling_parameters": json.dumps(GREEDY)})
        assert code == 400 and "restarting after the engine process exited" in body
        _, refused = collect(srv, grpc_inputs(PROMPT, GREEDY))          # a gRPC stream's error carries the text
        assert refused is not None and "restarting after the engine process exited" in str(refused)
        engine_pid(log, before=first)
        wait_until(lambda: collect(srv, grpc_inputs(PROMPT, GREEDY))[1] is None, "the server to serve again",
                   timeout=BACK_WITHIN)
        again, _ = collect(srv, grpc_inputs(PROMPT, GREEDY))
        assert [r["output_ids"].tolist() for r in again] == [r["output_ids"].tolist() for r in want]
        wait_until(lambda: scrape(srv.metrics_url, "pagoda_engine_restarts_total") == 1, "the restart counted")
        assert scrape(srv.metrics_url, "pagoda_kv_blocks", state="used") == 0
        ready = f"http://{srv.http_url}/v2/models/llm/ready"
        assert status(ready) == 200
        os.kill(engine_pid(log, before=first), signal.SIGKILL)          # the second death within a minute
        wait_until(lambda: status(ready) != 200, "the model to be unloaded (not ready)", timeout=BACK_WITHIN)
        assert "not restarting it (a crash loop" in log.read_text(errors="replace")
    finally:
        stop_checked(srv)


def test_openai_server_restarts_a_killed_engine_and_reports_a_crash_loop(tiny_dir, tmp_path):
    log = tmp_path / "server.log"
    proc, url = start(tiny_dir, log, "--restart-limit", "2", "--restart-delay-ms", "3000")
    body = {"model": "tiny0", "prompt": PROMPT, **GREEDY}
    try:
        code, want = post(url, "/v1/completions", body)
        assert code == 200
        first = engine_pid(log)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: status(f"http://{url}/health") == 503, "/health to say the engine is down")
        code, refused = post(url, "/v1/completions", body)
        assert code == 503 and "restarting" in refused["error"]["message"]
        wait_until(lambda: status(f"http://{url}/health") == 200, "the engine back", timeout=BACK_WITHIN)
        code, again = post(url, "/v1/completions", body)
        assert code == 200 and again["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        metrics = f"http://{url}/metrics"
        assert scrape(metrics, "pagoda_engine_restarts_total") == 1
        assert scrape(metrics, "pagoda_kv_blocks", state="used") == 0
        os.kill(engine_pid(log, before=first), signal.SIGKILL)
        wait_until(lambda: urllib_json(f"http://{url}/health").get("status") == "failed", "the crash loop",
                   timeout=BACK_WITHIN)
        code, refused = post(url, "/v1/completions", body)
        assert code == 503 and "crash loop" in refused["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


def generate(srv, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/llm/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def urllib_json(url: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(url, timeout=10).read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())
