"""Triton tensors <-> engine requests, free of Triton itself: names and types follow Triton's vLLM backend."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from engine.core.output import PositionLogprobs
from engine.core.sampling import INTEGER_KEYS, SamplingParams

EXTRAS = {"return_finish_reason": ("finish_reason",), "return_cumulative_logprob": ("cumulative_logprob",),
          "return_logprobs": ("logprobs",), "return_num_input_tokens": ("num_input_tokens",),
          "return_num_output_tokens": ("num_output_tokens",), "return_cached_tokens": ("cached_tokens",),
          "return_decode_timing": ("decode_tok_s", "decode_cpu_ms")}        # the last one is Pagoda's own

INPUTS = [  # name, data_type, dims, optional
    ("text_input", "TYPE_STRING", [1], True), ("input_ids", "TYPE_INT32", [-1], True),
    ("stream", "TYPE_BOOL", [1], True), ("sampling_parameters", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    *[(name, "TYPE_BOOL", [1], True) for name in EXTRAS],
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]), ("output_ids", "TYPE_INT32", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]), ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("logprobs", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_UINT32", [1]), ("num_output_tokens", "TYPE_UINT32", [-1]),
    ("cached_tokens", "TYPE_UINT32", [1]),
    ("decode_tok_s", "TYPE_FP32", [-1]), ("decode_cpu_ms", "TYPE_FP32", [-1]),
]


@dataclass(slots=True)
class TritonRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    prepend_input: bool = False
    extras: list[str] = field(default_factory=list)    # output names asked for with return_* flags


def _one(inputs: dict[str, np.ndarray], name: str, what: str):
    """The single element of an optional input, or None when absent."""
    arr = inputs.get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name}: expected one {what}, got {flat.size} values")
    return flat[0]


def _flag(inputs: dict[str, np.ndarray], name: str) -> bool | None:
    value = _one(inputs, name, "boolean")
    return None if value is None else bool(value)


def _string(inputs: dict[str, np.ndarray], name: str) -> str | None:
    value = _one(inputs, name, "string")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return None if value is None else str(value)


def parse(inputs: dict[str, np.ndarray], parameters: str | dict | None = None) -> TritonRequest:
    """Validate a request's input tensors and its Triton request parameters (`request.parameters()`, a JSON object
    as text); raises ValueError naming the field."""
    text = _string(inputs, "text_input")
    ids = inputs.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("text_input: give exactly one of text_input and input_ids")
    if ids is not None:
        ids = np.asarray(ids)
        if ids.dtype != np.int32:
            raise ValueError(f"input_ids: expected INT32, got {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"input_ids: expected rank 1, got shape {list(ids.shape)}")
        prompt: str | list[int] = ids.tolist()
    else:
        prompt = text
    raw = _string(inputs, "sampling_parameters")
    params = SamplingParams.from_json(raw) if raw is not None else from_parameters(parameters)
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs: not supported by this model: vllm_backend has no output tensor for it")
    stream = bool(_flag(inputs, "stream"))
    exclude = _flag(inputs, "exclude_input_in_output")
    if stream and exclude is False:
        raise ValueError("exclude_input_in_output: false is not allowed when streaming")
    prepend = exclude is False or (exclude is None and not stream and text is not None)
    extras = [out for flag, outs in EXTRAS.items() if _flag(inputs, flag) for out in outs]
    return TritonRequest(prompt, params, stream, prepend and text is not None, extras)


# Keys whose values are lists or objects: a Triton parameter is a string, number or boolean, so a client sends these
# as JSON text. `stop` may also be one plain stop string.
_JSON_VALUED = {"stop", "stop_token_ids", "bad_words", "allowed_token_ids", "logit_bias"}


def from_parameters(parameters: str | dict | None) -> SamplingParams:
    """Sampling parameters from a request's Triton parameters, which vllm_backend reads when no sampling_parameters
    tensor is sent (the HTTP generate endpoint puts the body's `parameters`, and any top-level key that names no
    input, there; gRPC clients set them per request). Values are Triton's types: strings, integers, doubles, booleans.
    A JSON list or object given as text is parsed for the keys that need one; a whole double (12.0) is taken where an
    integer is needed."""
    if isinstance(parameters, (str, bytes)):
        try:
            parameters = json.loads(parameters) if parameters else {}
        except ValueError as e:
            raise ValueError(f"parameters: not valid JSON ({e})") from None
    data = dict(parameters or {})
    for key, value in data.items():
        if key in _JSON_VALUED and isinstance(value, str) and value.strip()[:1] in ("[", "{"):
            try:
                data[key] = json.loads(value)
            except ValueError:
                if key != "stop":           # a stop string may start with a bracket
                    raise ValueError(f"{key}: expected JSON text of a list, got {value!r}") from None
        elif key in INTEGER_KEYS and isinstance(value, float) and value.is_integer():
            data[key] = int(value)
    return SamplingParams.from_dict(data)


def error_message(message: str) -> str:
    """An engine error in Triton's names: the engine calls a text prompt `prompt`, Triton calls it text_input."""
    return "text_input:" + message[len("prompt:"):] if message.startswith("prompt:") else message


@dataclass(slots=True)
class Part:
    """One sequence's share of one response."""
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative: float | None = None
    timing: tuple[float, float] | None = None      # the engine's (decode tok/s, CPU ms per token), once ended


def outputs(parts: list[Part], extras: list[str], num_input: int, cached: int) -> dict[str, np.ndarray]:
    """Output tensors of one response, as vllm_backend defines them, with one element per sequence (n of them) in
    text_output, finish_reason, num_output_tokens, logprobs and cumulative_logprob. The return_* extras ride on
    every response: finish_reason is "None" while a sequence runs (vllm_backend sends str(None)); num_output_tokens
    counts the sequence's tokens in this response, so a client that sums them gets the total; logprobs is the JSON
    of this response's positions ([{token id: {logprob, rank, decoded_token}}], "null" when the request did not ask
    for logprobs); cumulative_logprob is the sum over all tokens so far (NaN when it did not ask, as vLLM V1
    reports None). output_ids (Pagoda's) is the sequences' ids of this response, concatenated in index order.
    decode_tok_s and decode_cpu_ms (Pagoda's, return_decode_timing) are the engine's own measure of each sequence's
    decode, from its first sampled token to its last, free of the transport: 0 until the sequence ends (and for one
    of fewer than two tokens); not NaN, which perf_analyzer's profile export cannot write."""
    def strings(values: list[str]) -> np.ndarray:
        return np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    out = {"text_output": strings([p.text for p in parts]),
           "output_ids": np.array([t for p in parts for t in p.ids], dtype=np.int32)}
    values = {"finish_reason": lambda: strings([str(p.finish_reason) for p in parts]),
              "num_input_tokens": lambda: np.array([num_input], dtype=np.uint32),
              "num_output_tokens": lambda: np.array([len(p.ids) for p in parts], dtype=np.uint32),
              "cached_tokens": lambda: np.array([cached], dtype=np.uint32),
              "cumulative_logprob": lambda: np.array([np.nan if p.cumulative is None else p.cumulative
                                                      for p in parts], dtype=np.float32),
              "logprobs": lambda: strings([logprobs_json(p.logprobs) for p in parts]),
              "decode_tok_s": lambda: np.array([p.timing[0] if p.timing else 0.0 for p in parts], np.float32),
              "decode_cpu_ms": lambda: np.array([p.timing[1] if p.timing else 0.0 for p in parts], np.float32)}
    out.update({name: values[name]() for name in extras})
    return out


def logprobs_json(logprobs: list[PositionLogprobs] | None) -> str:
    if logprobs is None:
        return "null"
    return json.dumps([{t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for t, lp in position.items()} for position in logprobs])


def config_io() -> tuple[list[dict], list[dict]]:
    """Inputs and outputs for auto_complete_config."""
    ins = [{"name": n, "data_type": t, "dims": d, "optional": o} for n, t, d, o in INPUTS]
    outs = [{"name": n, "data_type": t, "dims": d} for n, t, d in OUTPUTS]
    return ins, outs
