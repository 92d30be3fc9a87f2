"""Helpers shared by the tests: prompts, sampling params, stepping an engine, and talking to the servers."""
from __future__ import annotations

import json
import queue
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from contextlib import contextmanager

from engine import LLM, SamplingParams
from engine.core.engine import Engine
from engine.core.output import Delta
from scripts.ports import free_port


def random_ids(n: int, seed: int, low: int = 3, high: int = 900) -> list[int]:
    """Token ids from the trained tokenizer's range, skipping the special tokens at 0..2."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


ULP = dict(rtol=2 ** -7, atol=1e-5)       # bf16: one unit in the last place


def greedy(n: int, **kw) -> SamplingParams:
    """Greedy, EOS ignored unless `ignore_eos=False` says otherwise."""
    return SamplingParams(**{"max_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw})


def step(engine: Engine) -> list[Delta]:
    """One engine step; the deltas it made."""
    out: list[Delta] = []
    sink, engine.on_delta = engine.on_delta, out.append
    try:
        engine.step()
    finally:
        engine.on_delta = sink
    return out


def wait_until(check, what: str, timeout: float = 30.0) -> None:
    """Poll `check()` until it is true; a state, never a guess of how long something takes."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


# ---- the equivalence workload: four prompts of different lengths, greedy ----
LENGTHS = [37, 70, 101, 140]
MAX_TOKENS = [24, 9, 30, 17]


def workload_prompts() -> list[list[int]]:
    return [random_ids(n, seed=100 + i) for i, n in enumerate(LENGTHS)]


def workload_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]


def run_workload(llm: LLM, batch: bool) -> tuple[list[list[int]], list[int]]:
    if batch:
        outs = llm.generate(workload_prompts(), workload_params())
    else:
        outs = [llm.generate(p, sp)[0] for p, sp in zip(workload_prompts(), workload_params())]
    return [o.token_ids for o in outs], [o.cached_tokens for o in outs]


# ---- tritonserver ----
def stop_checked(srv) -> None:
    """Stop tritonserver; it must exit 0 (finalize must not hang or fail the shutdown). One exception, seen
    intermittently after client cancellations: tritonserver 2.51 never asks the Python model to finalize and exits 1
    after its exit timeout (the upstream unload deadlock of triton-inference-server/server#8755). That case must
    show in the log exactly so, with our finalize never called; it warns instead of failing."""
    rc = srv.stop(timeout=90)
    if rc != 0:
        log = srv.log.read_text(encoding="utf-8", errors="replace")
        assert "Exit timeout expired" in log and "pagoda: finalize" not in log, log[-3000:]
        warnings.warn("tritonserver did not unload the model before its exit timeout (upstream unload deadlock)")


def collect(server, inputs, cancel_after: int | None = None, timeout: float = 60):
    """(responses as dicts with a 'final' flag, error) of one streamed request."""
    import tritonclient.grpc as grpcclient
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
    responses, error = [], None
    try:
        while True:
            result, err = events.get(timeout=timeout)
            if err is not None:
                error = err
                break
            resp = result.get_response()
            fields = {o.name: result.as_numpy(o.name) for o in resp.outputs}
            fields["final"] = resp.parameters["triton_final_response"].bool_param
            responses.append(fields)
            if fields["final"]:
                break
            if cancel_after is not None and len(responses) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, error


# ---- the OpenAI server ----
def start_openai(tiny_dir, log_path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", tiny_dir, "--dtype", "float32",
                             "--port", str(port), *extra], stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://{url}/health", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(open(log_path).read())
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError("server did not start")


@contextmanager
def openai_serving(model_dir, log_path, *extra: str):
    """`python -m engine serve` on the model while the block runs (its address); it must stop cleanly after."""
    proc, url = start_openai(model_dir, log_path, *extra)
    try:
        yield url
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM)


def post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{url}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def missing_series(metrics_url: str) -> list[str]:
    """The registry's series (Metrics().series()) that a scrape of `metrics_url` lacks (histogram samples by name
    only: Triton spells their bounds its own way; the model_name label's value is the server's)."""
    from engine.serving.metrics import Metrics
    lines = [line for line in urllib.request.urlopen(metrics_url, timeout=10).read().decode().splitlines()
             if line and not line.startswith("#")]
    missing = []
    for name, labels in Metrics().series():
        histogram = name.endswith(("_bucket", "_count", "_sum"))
        want = [] if histogram else [f'{k}="{v}"' for k, v in labels.items() if k != "model_name"]
        if not any(line.split("{")[0].split(" ")[0] == name and all(w in line for w in want) for line in lines):
            missing.append(f"{name}{labels}")
    return missing


def triton_post(server, path: str, body: dict) -> tuple[int, bytes]:
    """POST JSON to a tritonserver's HTTP endpoint (generate, generate_stream): its status and raw body."""
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stacked(model_dir, dtype, gemv):
    """The model at `model_dir` in `dtype` (a torch dtype) with decode's CPU kernels: the GEMV, the pointwise ops and
    every layer in one call (cpu_layers) on 2 threads."""
    from engine.kernels import cpu_layers, cpu_pointwise
    from engine.models.loader import load_model
    model = load_model(model_dir, str(dtype).removeprefix("torch."))
    model.use_gemv(gemv)
    cfg = model.cfg
    model.use_kernels(gemv, cpu_pointwise.load(), cpu_layers.load(2, model.layers, cfg.rms_norm_eps, cfg.windows,
                                                                  model.rope_of))
    return model
