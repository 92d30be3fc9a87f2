"""A burst: far more concurrent requests than a server queues, some hung up mid-stream, some malformed, each one's
ending put in one of a few bins. What a client may see under overload is a completed request, a refusal before any
token (HTTP 429 with Retry-After, or Triton's UNAVAILABLE), its own hang-up, or a 4xx naming the bad field; any other
ending is `unexpected` (a 5xx, a stream cut without [DONE] or FINAL, an error after tokens).

    burst_openai(url, model, prompts, ...) / burst_grpc(url, model, prompts, ...) -> Counter of endings
"""
from __future__ import annotations

import http.client
import json
import queue
import threading
from collections import Counter
from collections.abc import Callable

BINS = ("completed", "refused", "disconnected", "malformed")


def _plan(n: int, hang_up_every: int, malformed_every: int) -> list[str]:
    """What each request of the burst does, spread evenly: hang up, go malformed, or run to its end."""
    return ["malformed" if malformed_every and i % malformed_every == malformed_every - 1 else
            "hang_up" if hang_up_every and i % hang_up_every == 0 else "whole" for i in range(n)]


def _run(n: int, one: Callable[[int, threading.Barrier], str]) -> Counter:
    """`one(i, go)` for every request, one thread each, sending together once all are connected (`go.wait()`);
    the Counter of what they returned."""
    endings: list[str] = [""] * n
    go = threading.Barrier(n, timeout=60)
    threads = [threading.Thread(target=lambda i=i: endings.__setitem__(i, _guard(one, i, go))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Counter(endings)


def _guard(one: Callable[[int, threading.Barrier], str], i: int, go: threading.Barrier) -> str:
    try:
        return one(i, go)
    except Exception as e:              # a transport failure the server caused is a finding, not a crash
        return f"unexpected: {type(e).__name__}: {e}"[:120]


def burst_openai(url: str, model: str, prompts: list[list[int]], max_tokens: int = 24, hang_up_every: int = 3,
                 malformed_every: int = 8, timeout: float = 120.0) -> Counter:
    """Completions, streamed and not (alternating), against an OpenAI-compatible server at host:port."""
    host, port = url.split(":")
    plan = _plan(len(prompts), hang_up_every, malformed_every)

    def one(i: int, go: threading.Barrier) -> str:
        stream = plan[i] == "hang_up" or i % 2 == 0
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        if plan[i] == "malformed":
            body["temperature"] = -1
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        hang_up = plan[i] == "hang_up"
        try:
            conn.connect()
            if not hang_up:     # the hang-ups go first, as their threads start, so some get a stream to leave
                go.wait()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status == 429:
                error = json.loads(resp.read())["error"]
                ok = resp.getheader("Retry-After", "").isdigit() and error["type"] == "overloaded"
                return "refused" if ok else f"unexpected: 429 without Retry-After or type: {error}"
            if 400 <= resp.status < 500:
                error = json.loads(resp.read())["error"]
                named = plan[i] == "malformed" and error.get("param") == "temperature"
                return "malformed" if named else f"unexpected: {resp.status} {error['message'][:60]}"
            if resp.status != 200:
                return f"unexpected: HTTP {resp.status}"
            if not stream:
                out = json.loads(resp.read())
                return "completed" if out["choices"][0]["finish_reason"] == "length" else "unexpected: not whole"
            return _read_sse(resp, hang_up)
        finally:
            conn.close()
            if hang_up:         # then the rest are released together
                go.wait()
    return _run(len(prompts), one)


def _read_sse(resp: http.client.HTTPResponse, hang_up: bool) -> str:
    events = 0
    for line in resp:
        if not line.startswith(b"data:"):
            continue
        if line.strip() == b"data: [DONE]":
            return "completed"
        if b'"error"' in line:
            return f"unexpected: error event {line[:100]!r}"
        events += 1
        if hang_up and events == 2:
            return "disconnected"
    return "unexpected: stream ended without [DONE]"


def burst_grpc(url: str, model: str, prompts: list[list[int]], max_tokens: int = 24, hang_up_every: int = 3,
               malformed_every: int = 8, timeout: float = 120.0) -> Counter:
    """Streamed requests to a Triton model over gRPC, one client stream each; a hang-up stops its stream right after
    sending."""
    import tritonclient.grpc as grpcclient

    from client.stream import grpc_inputs
    plan = _plan(len(prompts), hang_up_every, malformed_every)

    def one(i: int, go: threading.Barrier) -> str:
        params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": -1 if plan[i] == "malformed" else 0}
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        tokens = 0
        try:
            inputs = grpc_inputs(prompts[i], params)
            go.wait()
            client.async_stream_infer(model, inputs)
            if plan[i] == "hang_up":            # at once: tritonserver 2.51 can crash when a stream is cancelled
                return "disconnected"           # while a response is being sent (server#8034, docs/operations.md)
            while True:
                result, error = events.get(timeout=timeout)
                if error is not None:
                    text = str(error)
                    if tokens == 0 and "max_queue" in text:     # a stream's error carries its message only
                        return "refused"
                    if tokens == 0 and plan[i] == "malformed" and "temperature" in text:
                        return "malformed"
                    return f"unexpected: {text[:100]}"
                response = result.get_response()
                tokens += len(result.as_numpy("output_ids"))
                if response.parameters["triton_final_response"].bool_param:
                    return "completed" if tokens == max_tokens else f"unexpected: {tokens} tokens"
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()
    return _run(len(prompts), one)
