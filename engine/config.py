"""Every option once: EngineConfig (and the OpenAI server's ServeConfig) fields carry their help text, choices and
bounds, and CLI flags, LLM(**kwargs), config.pbtxt parameters and PAGODA_<NAME> environment variables all derive
from them. Every PAGODA_* variable is read here and nowhere else.

Precedence: what a process is told directly (a CLI flag, an LLM keyword) wins over PAGODA_<NAME>, which wins over
the files (a Triton model's model.json, then its config.pbtxt parameters) and the defaults.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def option(default: Any, help: str, choices: tuple[str, ...] = (), low: int | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "low": low})


@dataclass(slots=True)
class EngineConfig:
    """Every engine option, once: the model, where it runs, the KV cache, scheduling, serving. Each field is also a
    CLI flag (`--max-batch-size`), an `LLM(...)` keyword, a config.pbtxt parameter and `PAGODA_MAX_BATCH_SIZE`.
    Each field's help text gives its unit and bounds; docs/options.md lists them all with their defaults."""
    model: str | None = option(None, "Hugging Face model directory (default: the embedded small model)")
    tokenizer: str | None = option(None, "directory holding tokenizer.json and tokenizer_config.json (default: "
                                   "the model's)")
    served_model_name: str | None = option(None, "the model's name in the API and the metrics' model_name label "
                                           "(default: the model directory's)")
    runner: str = option("torch", "model runner", ("torch", "mlx"))
    device: str = option("auto", "torch device", ("auto", "cpu", "cuda"))
    dtype: str = option("auto", "weights and KV dtype; auto follows the checkpoint",
                        ("auto", "float32", "bfloat16", "float16"))
    quantization: str = option("none", "torch runner on a CPU: quantize a safetensors model's linear weights at load "
                               "into GGUF's blocks (q8_0; q4_0 with the embedding and head in q8_0) and decode from "
                               "them (vLLM's name)", ("none", "q8_0", "q4_0"))
    quantized_activations: str = option("mixed", "weights in blocks (a quantized GGUF, quantization): decode's x "
                                        "rounded to int8 per 32 values as llama.cpp's (int8); so, with a second int8 "
                                        "digit in x's outlier blocks (mixed); as two int8 digits, about 16 bits "
                                        "(int16); in fp32, slower (float32). Prefill's x: int16 where the CPU has "
                                        "AVX512-VNNI (bf16 beside int8 and mixed where it has AMX), else bf16 where "
                                        "it has bf16 arithmetic (int8, mixed), else fp32",
                                        ("mixed", "int8", "int16", "float32"))
    max_batch_size: int = option(4, "requests decoded together", low=1)
    kv_storage: str = option("auto", "KV layout; auto is paged iff max_batch_size > 1", ("auto", "paged", "dense"))
    block_size: int = option(32, "tokens per KV block (paged)", low=1)
    contiguous_blocks: bool = option(True, "keep a sequence's blocks consecutive where free (false: release order)")
    num_kv_blocks: int = option(0, "KV blocks in the pool; 0: derived from kv_cache_bytes and max_model_len", low=0)
    kv_cache_bytes: int = option(1 << 30, "KV pool bound in bytes when num_kv_blocks is 0", low=0)
    gpu_memory_utilization: float = option(0.0, "CUDA: the share of device memory this engine may hold (weights, "
                                           "activations, KV); the KV pool takes what weights and activations "
                                           "leave. 0: kv_cache_bytes bounds the pool; no effect on a CPU")
    disable_hybrid_kv_cache_manager: bool = option(False, "paged: one block table for every layer, so sliding-"
                                                   "window layers keep KV they can no longer read (vLLM's flag)")
    prompt_cache: bool = option(True, "reuse the KV of earlier requests' prefixes")
    prompt_cache_bytes: int = option(512 << 20, "dense storage: bound of the store of finished buffers", low=0)
    lookahead: bool = option(True, "launch decode step n+1 before reading step n (PAGODA_FORCE_SYNC=1 overrides)")
    speculative_config: str | None = option(None, "n-gram speculative decoding, as vLLM's JSON object: {\"method\": "
                                            "\"ngram\", \"num_speculative_tokens\": K, \"prompt_lookup_min\": N, "
                                            "\"prompt_lookup_max\": M} (off by default)")
    prefill_chunk: int = option(512, "prompt tokens prefilled per step, over all requests", low=1)
    max_queue: int = option(256, "requests waiting before new ones are refused (HTTP 429, Triton UNAVAILABLE)",
                            low=1)
    max_queue_wait: float = option(0.0, "refuse a request whose estimated wait in the queue (by the measured rate "
                                   "at which requests leave it) exceeds this many seconds; 0: no bound")
    max_model_len: int = option(0, "context length; 0: the checkpoint's max_position_embeddings", low=0)
    seed: int = option(0, "seed of the embedded default model", low=0)
    sampling_seed: int = option(0, "seed of the generator that sampled requests without a seed of their own draw "
                                "from (vLLM's engine seed)", low=0)
    max_logprobs: int = option(20, "most logprobs a request may ask for per position (at most 20)", low=0)
    num_threads: int = option(0, "CPU threads for the model's ops; 0: the framework's default", low=0)
    attention: str = option("auto", "torch runner's KV ops; auto: triton on CUDA, cpu for fp32 and bf16 on a CPU "
                            "that builds it, else reference", ("auto", "triton", "reference", "cpu"))
    compile: bool = option(False, "torch runner, paged: torch.compile the decode step (each new shape compiles once)")
    cuda_graphs: str = option("auto", "torch runner, paged: decode replays CUDA graphs captured per batch-size bucket "
                              "(auto: on CUDA unless compile; true on a CPU runs the same fixed-shape step uncaptured)",
                              ("auto", "true", "false"))
    kv_events: bool = option(False, "publish KV cache events (vLLM's format, ZMQ PUB) for cache-aware routers; "
                             "paged KV with the prompt cache")
    kv_events_endpoint: str = option("tcp://*:5557", "kv_events: the PUB socket's address (a wildcard binds, "
                                     "anything else connects)")
    kv_events_topic: str = option("", "kv_events: the topic frame of each message")
    engine_process: bool = option(True, "front ends: run the step loop in a child process (false: a thread)")
    restart_limit: int = option(5, "engine process deaths within restart_window that end its restarts (then the "
                                "front end reports not ready)", low=1)
    restart_window: int = option(60, "seconds over which restart_limit counts deaths", low=1)
    restart_delay_ms: int = option(250, "wait before restarting a dead engine process; doubles with each death in "
                                   "the window, up to 8 s", low=0)

    def __post_init__(self) -> None:
        if self.quantization is None:         # vLLM's default
            self.quantization = "none"
        validate(self)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in [0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.max_queue_wait, bool) or not isinstance(self.max_queue_wait, (int, float)) or \
                self.max_queue_wait < 0:
            raise ValueError(f"max_queue_wait: must be a number of seconds >= 0, got {self.max_queue_wait!r}")
        if self.max_logprobs > 20:
            raise ValueError(f"max_logprobs: this server returns at most 20 logprobs a position, got "
                             f"{self.max_logprobs}")
        from engine.core.ngram import NgramConfig
        NgramConfig.parse(self.speculative_config)             # names a bad key before any weight loads
        if self.quantization != "none" and self.runner != "torch":
            raise ValueError(f"quantization: {self.quantization} needs the torch runner, got runner {self.runner!r}")
        if self.quantization != "none" and str(self.model or "").endswith(".gguf"):
            raise ValueError(f"quantization: {self.quantization} quantizes a safetensors model; a GGUF file keeps "
                             "its own blocks")
        if self.compile and self.runner != "torch":
            raise ValueError(f"compile: only the torch runner compiles, got runner {self.runner!r}")
        if self.kv_events and (not self.paged or not self.prompt_cache):
            raise ValueError("kv_events: needs paged KV and the prompt cache "
                             f"(kv_storage {self.kv_storage!r}, prompt_cache {self.prompt_cache})")
        if self.cuda_graphs == "true" and self.compile:
            raise ValueError("cuda_graphs: true and compile: true both replace the eager decode step; pick one")
        if self.cuda_graphs == "true" and (self.runner != "torch" or not self.paged):
            raise ValueError("cuda_graphs: true needs the torch runner and paged KV "
                             f"(runner {self.runner!r}, kv_storage {self.kv_storage!r})")

    @property
    def paged(self) -> bool:
        if self.kv_storage == "auto":
            return self.max_batch_size > 1
        return self.kv_storage == "paged"

    @property
    def model_name(self) -> str:
        """The served name: served_model_name, else the model directory's name (a .gguf file's: its stem)."""
        if self.served_model_name:
            return self.served_model_name
        name = os.path.basename(os.path.normpath(self.model)) if self.model else "small"
        return name.removesuffix(".gguf")

    @property
    def use_lookahead(self) -> bool:
        return self.lookahead and not force_sync()

    @property
    def failpoints(self) -> set[int]:
        return failpoint_steps()

    @property
    def hit_decode_delay(self) -> float:
        return hit_decode_delay()

    @classmethod
    def from_strings(cls, values: Mapping[str, Any]) -> EngineConfig:
        """From string values (config.pbtxt parameters, env); an unknown name is an error naming it."""
        return build(cls, values, {})

    @classmethod
    def from_sources(cls, values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> EngineConfig:
        """`values` (config.pbtxt parameters), each overridden by PAGODA_<NAME> from the environment."""
        return build(cls, {**values, **from_env(cls, env)}, {})


@dataclass(slots=True)
class ServeConfig:
    """The OpenAI-compatible server's own options (`python -m engine serve`)."""
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8080, "port to bind", low=0)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1/*")
    max_body_bytes: int = option(8 << 20, "refuse larger request bodies with 413", low=1)
    enable_auto_tool_choice: bool = option(False, 'let chat requests leave tool calls to the model (tool_choice '
                                           '"auto"; needs tool_call_parser)')
    tool_call_parser: str | None = option(None, "the format tool calls are read in (auto: the chat template's)",
                                          (None, "hermes", "llama3_json", "mistral", "auto"))
    reasoning_parser: str | None = option(None, "return the text between <think> and </think> as message.reasoning",
                                          (None, "qwen3", "deepseek_r1"))

    def __post_init__(self) -> None:
        validate(self)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser")


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The allowed values of one field, for code that checks them outside the dataclass."""
    return next(f for f in fields(cls) if f.name == name).metadata["choices"]


def validate(config: Any) -> None:
    for f in fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if meta["choices"] and value not in meta["choices"]:
            raise ValueError(f"{f.name}: must be one of {', '.join(meta['choices'])}, got {value!r}")
        if meta["low"] is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.name}: expected an integer, got {value!r}")
            if value < meta["low"]:
                raise ValueError(f"{f.name}: must be >= {meta['low']}, got {value}")


def from_env(cls: type, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The PAGODA_<NAME> values set for `cls`'s fields."""
    env = os.environ if env is None else env
    return {f.name: env[key] for f in fields(cls) if (key := f"PAGODA_{f.name.upper()}") in env}


def build(cls: type, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> Any:
    """`cls` from `values` over `defaults` (strings are parsed by the field's type)."""
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, raw in {**defaults, **values}.items():
        if name not in known:
            what = "engine option" if cls is EngineConfig else "option"
            raise ValueError(f"{name}: unknown {what}")
        kwargs[name] = parse(name, known[name].type, raw)
    return cls(**kwargs)


def parse(name: str, type_: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if "bool" in type_:
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if "int" in type_:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if "float" in type_:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name}: expected a number, got {raw!r}") from None
    if "None" in type_ and text in ("", "none", "None"):
        return None
    return text


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One --flag-name per field but `skip`; flags not given stay out of the namespace (see `from_flags`)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        default = None if f.default is MISSING else f.default
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                            choices=[c for c in meta["choices"] if c is not None] or None,
                            metavar=None if meta["choices"] else _metavar(f.type),
                            **({"nargs": "?", "const": True} if f.type == "bool" else {}),
                            help=f"{meta['help']} (default: {default}; env PAGODA_{f.name.upper()})")


def from_flags(cls: type, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    """`cls` from the flags given, over PAGODA_<NAME>, over the defaults."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return build(cls, given, from_env(cls, env))


def from_kwargs(cls: type, kwargs: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Any:
    """`cls` from keyword arguments (LLM(**kwargs)), over PAGODA_<NAME>, over the defaults."""
    return build(cls, kwargs, from_env(cls, env))


def _metavar(type_: str) -> str:
    return "BOOL" if "bool" in type_ else "N" if "int" in type_ else "X" if "float" in type_ else "TEXT"


# ---- process-wide switches: environment only ----

def _env_flag(name: str, default: bool) -> bool:
    text = os.environ.get(name, "").strip().lower()
    return default if text == "" else text not in FALSE


def force_sync() -> bool:
    """PAGODA_FORCE_SYNC=1: the kill switch of lookahead decode."""
    return _env_flag("PAGODA_FORCE_SYNC", False)


def failpoint_steps() -> set[int]:
    """PAGODA_FAILPOINT_STEPS=5,9: those engine steps raise mid-step (fault injection for reliability tests)."""
    return {int(n) for n in os.environ.get("PAGODA_FAILPOINT_STEPS", "").split(",") if n.strip()}


def hit_decode_delay() -> float:
    """PAGODA_FAILPOINT_HIT_DECODE_MS=2: every decode tick whose batch holds a prompt-cache hit sleeps that long
    (seconds returned; 0 when unset): the seed's defect on demand, so the main job's verdict can be shown to see it."""
    text = os.environ.get("PAGODA_FAILPOINT_HIT_DECODE_MS", "").strip()
    return float(text) / 1000 if text else 0.0


def cpu_kernels() -> bool:
    """PAGODA_CPU_KERNELS=0 turns the C++ CPU kernels off; torch's ops serve instead."""
    return _env_flag("PAGODA_CPU_KERNELS", True)


def cache_root() -> Path:
    """Pagoda's cache folder (models made from presets, built kernels): $PAGODA_CACHE, else ~/.cache/pagoda."""
    return Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda"))
