"""EngineConfig: one set of option names for CLI flags, config.pbtxt parameters and env."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None          # HF directory; None means the embedded default (small preset)
    runner: str = "torch"             # torch | mlx
    device: str = "auto"              # auto | cpu | cuda
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    max_batch_size: int = 4
    kv_storage: str = "auto"          # auto | paged | dense
    block_size: int = 32
    contiguous_blocks: bool = True    # keep a sequence's blocks consecutive where free (False: release order)
    num_kv_blocks: int = 0            # 0: derived from kv_cache_bytes and max_model_len
    kv_cache_bytes: int = 1 << 30
    prompt_cache: bool = True
    prompt_cache_bytes: int = 512 << 20   # dense storage: bound of the donated-buffer store
    lookahead: bool = True
    prefill_chunk: int = 512
    max_queue: int = 256
    max_model_len: int = 0            # 0: the checkpoint's max_position_embeddings
    seed: int = 0                     # seed of the embedded default model
    num_threads: int = 0              # CPU threads for the model's ops; 0: the framework's default
    attention: str = "auto"           # torch runner's KV ops: triton | reference | cpu (fp32 on CPU, C decode step);
    #                                   auto: triton on CUDA, cpu for fp32 on a CPU that builds it, else reference
    compile: bool = False             # torch runner, paged: torch.compile the decode step (each new shape compiles once)
    engine_process: bool = True       # front ends (Triton model, serve): the step loop in a child process

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        choices = {"runner": ("torch", "mlx"), "device": ("auto", "cpu", "cuda"),
                   "dtype": ("auto", "float32", "bfloat16", "float16"),
                   "kv_storage": ("auto", "paged", "dense"), "attention": ("auto", "triton", "reference", "cpu")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.compile and self.runner != "torch":
            raise ValueError(f"compile: only the torch runner compiles, got runner {self.runner!r}")
        for name in ("max_batch_size", "block_size", "prefill_chunk", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "max_model_len", "kv_cache_bytes", "prompt_cache_bytes", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def paged(self) -> bool:
        if self.kv_storage == "auto":
            return self.max_batch_size > 1
        return self.kv_storage == "paged"

    @property
    def use_lookahead(self) -> bool:
        return self.lookahead and os.environ.get("PAGODA_FORCE_SYNC", "0") in ("", "0")

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from string values (config.pbtxt parameters, env); unknown names are an error."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            if name not in known:
                raise ValueError(f"{name}: unknown engine option")
            kwargs[name] = _parse(name, known[name].type, raw)
        return cls(**kwargs)

    @classmethod
    def from_sources(cls, values: dict[str, Any], env: dict[str, str] | None = None) -> "EngineConfig":
        """`values` (config.pbtxt parameters), each overridden by PAGODA_<NAME> from the environment."""
        env = os.environ if env is None else env
        merged = dict(values)
        for f in fields(cls):
            key = f"PAGODA_{f.name.upper()}"
            if key in env:
                merged[f.name] = env[key]
        return cls.from_strings(merged)


def _parse(name: str, type_: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if "bool" in type_:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if "int" in type_:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if "None" in type_ and text in ("", "none", "None"):
        return None
    return text
