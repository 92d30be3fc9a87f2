"""Stream one completion from the Triton model and report TTFT, decode tok/s, cached tokens, finish reason.

    python -m client.stream --prompt "Hello" --max-tokens 32 [--url 127.0.0.1:8001] [--protocol grpc|http]
Decode rate = (tokens - 1) / (t_last_token - t_first_token), from token arrival times.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_cached_tokens",
         "return_decode_timing")


@dataclass(slots=True)
class Result:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)   # one per token, arrival time
    finish_reason: str = ""
    num_input_tokens: int = 0
    cached_tokens: int = 0
    engine_decode_tok_s: float = float("nan")     # the engine's own decode rate and CPU ms per token (Triton's
    engine_decode_cpu_ms: float = float("nan")    # return_decode_timing), once the request ends
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start if self.token_times else float("nan")

    @property
    def decode_rate(self) -> float:
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")


def _apply(result: Result, fields: dict, now: float) -> None:
    ids = fields.get("output_ids")
    ids = [] if ids is None else [int(i) for i in np.atleast_1d(ids)]
    result.ids += ids
    result.token_times += [now] * len(ids)
    text = fields.get("text_output")
    if text is not None:
        result.text += "".join(t.decode() if isinstance(t, bytes) else str(t) for t in np.atleast_1d(text))
    if fields.get("finish_reason") is not None:
        v = np.atleast_1d(fields["finish_reason"])[0]
        result.finish_reason = v.decode() if isinstance(v, bytes) else str(v)
    for name in ("num_input_tokens", "cached_tokens"):
        if fields.get(name) is not None:
            setattr(result, name, int(np.atleast_1d(fields[name])[0]))
    for name in ("decode_tok_s", "decode_cpu_ms"):
        value = fields.get(name)
        value = 0.0 if value is None else float(np.atleast_1d(value)[0])       # 0 until the request ends
        if value > 0:
            setattr(result, f"engine_{name}", value)


def grpc_inputs(prompt: str | list[int], params: dict, stream: bool = True, **flags: bool) -> list:
    """tritonclient gRPC inputs: text_input or input_ids, stream, sampling_parameters, and BOOL flags."""
    import tritonclient.grpc as grpcclient
    inputs = []

    def add(name: str, value: np.ndarray, dtype: str) -> None:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    if isinstance(prompt, str):
        add("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")
    else:
        add("input_ids", np.array(prompt, dtype=np.int32), "INT32")
    add("stream", np.array([stream]), "BOOL")
    add("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES")
    for name, value in flags.items():
        add(name, np.array([value]), "BOOL")
    return inputs


def stream_grpc(url: str, model: str, prompt: str | list[int], params: dict,
                on_text: Callable[[str], None] | None = None, timeout: float = 600.0) -> Result:
    import tritonclient.grpc as grpcclient
    inputs = grpc_inputs(prompt, params, stream=True, **{flag: True for flag in FLAGS})
    events: queue.Queue = queue.Queue()
    result = Result()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    try:
        result.start = time.perf_counter()
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            now, res, err = events.get(timeout=timeout)
            if err is not None:
                result.error = str(err)
                break
            response = res.get_response()
            fields = {o.name: res.as_numpy(o.name) for o in response.outputs}
            before = len(result.text)
            _apply(result, fields, now)
            if on_text and len(result.text) > before:
                on_text(result.text[before:])
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return result


def stream_http(url: str, model: str, prompt: str, params: dict,
                on_text: Callable[[str], None] | None = None, timeout: float = 600.0) -> Result:
    body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(params),
            **{flag: True for flag in FLAGS}}
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    result = Result(start=time.perf_counter())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if "error" in event:
                result.error = event["error"]
                break
            before = len(result.text)
            _apply(result, event, now)
            if on_text and len(result.text) > before:
                on_text(result.text[before:])
    return result


def stream_openai(url: str, model: str, prompt: str | list[int], params: dict,
                  on_text: Callable[[str], None] | None = None, timeout: float = 600.0,
                  headers: dict[str, str] | None = None) -> Result:
    """POST /v1/completions with stream=true (SSE); token ids come from the engine's `token_ids` extension
    when present, else one token per chunk. `headers` go with the request (a router's session key)."""
    body = {"model": model, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": params.get("max_tokens", 16), "temperature": params.get("temperature", 1.0),
            **{k: v for k, v in params.items() if k not in ("max_tokens", "temperature")}}
    req = urllib.request.Request(f"http://{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    result = Result(start=time.perf_counter())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if "error" in event:
                result.error = str(event["error"])
                break
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or ([] if not choice.get("text") else [-1])
                result.ids += ids
                result.token_times += [now] * len(ids)
                result.text += choice.get("text", "")
                if on_text and choice.get("text"):
                    on_text(choice["text"])
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage:
                result.num_input_tokens = usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens", 0)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 for grpc, :8000 for http)")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    args = ap.parse_args()
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
    stream = stream_grpc if args.protocol == "grpc" else stream_http
    r = stream(url, args.model, args.prompt, params, on_text=show)
    print()
    if r.error:
        print(f"error: {r.error}", file=sys.stderr)
        return 1
    print(f"ttft={r.ttft * 1000:.1f}ms decode={r.decode_rate:.1f}tok/s tokens={len(r.ids)} "
          f"cached={r.cached_tokens}/{r.num_input_tokens} finish_reason={r.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
