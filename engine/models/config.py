"""ModelConfig: one decoder described by data, read from a Hugging Face config.json (transformers 4 or 5 layout).

Qwen2, Llama 3.x (and SmolLM2), Mistral, Qwen3 and Gemma 3 differ only in what this holds: projection biases, the
head size, per-head q/k norms, the norm's style and count, the activation, the embedding scale, the attention scale,
RoPE per layer type, sliding windows per layer and the final logit softcap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Per architecture: what its config.json leaves implicit (transformers' modeling_*.py fixes it in code).
FAMILIES: dict[str, dict] = {
    "Qwen2ForCausalLM": dict(qkv_bias=True),
    "LlamaForCausalLM": dict(),
    "MistralForCausalLM": dict(),
    "Qwen3ForCausalLM": dict(qk_norm=True),
    "Gemma3ForCausalLM": dict(qk_norm=True, gemma_norms=True),
}
SUPPORTED = tuple(FAMILIES)
# for a config.json without `architectures`
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_KINDS = ("default", "linear", "llama3")


def check_architecture(data: dict) -> str:
    """The checkpoint's architecture; refused by name, before any weight is read, when this engine cannot run it."""
    names = data.get("architectures") or []
    known = [n for n in names if n in FAMILIES]
    if known:
        return known[0]
    if not names and data.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[data["model_type"]]
    what = f"architecture {names[0]!r}" if names else f"model_type {data.get('model_type')!r}"
    raise ValueError(f"model: {what} is not supported (supported: {', '.join(SUPPORTED)})")


@dataclass(slots=True, frozen=True)
class RopeSpec:
    theta: float = 10_000.0
    kind: str = "default"             # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    divisors: tuple[float, ...] = ()  # per frequency (llama.cpp's rope_freqs tensor: Llama 3's scaling in a GGUF)

    @classmethod
    def of(cls, params: dict | None, theta: float) -> "RopeSpec":
        params = params or {}
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_KINDS:
            raise ValueError(f"model: rope_type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return cls(float(params.get("rope_theta", theta)), kind, **{k: params[k] for k in keys if k in params},
                   divisors=tuple(params.get("rope_freqs", ())))


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0                 # 0: hidden_size // num_attention_heads
    architecture: str = "Qwen2ForCausalLM"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    qkv_bias: bool = False            # biases on q/k/v (Qwen2 always; others from attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False             # RMSNorm per head on q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False         # x * (1 + w) in fp32, four norms a layer, sqrt(hidden) embedding scale
    activation: str = "silu"
    attn_scale: float = 0.0           # 0: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None = None
    layer_types: list[str] = field(default_factory=list)      # per layer: full_attention | sliding_attention
    sliding_window: int = 0           # positions a sliding layer's query sees, itself included
    rope: dict[str, RopeSpec] = field(default_factory=lambda: {FULL: RopeSpec(1_000_000.0)})

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.attn_scale = self.attn_scale or self.head_dim ** -0.5
        self.layer_types = self.layer_types or [FULL] * self.num_hidden_layers
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model: hidden_act {self.activation!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {FULL, SLIDING}:
            raise ValueError(f"model: layer_types must name {FULL} or {SLIDING} for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise ValueError("model: sliding_attention layers need a positive sliding_window")

    @property
    def windows(self) -> list[int]:
        """Per layer, how many positions a query sees (itself included); 0: all of them."""
        return [self.sliding_window if t == SLIDING else 0 for t in self.layer_types]

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """A Hugging Face directory's config, or a .gguf file's metadata as transformers reads it."""
        path = Path(path)
        if path.suffix == ".gguf":
            from engine.models import gguf_file
            return cls.from_hf(gguf_file.hf_config(path))
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json (it takes a Hugging Face model directory)")
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
        eos = data.get("eos_token_id")
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id", eos)
        return cls.from_hf(data, eos)

    @classmethod
    def from_hf(cls, data: dict, eos: int | list[int] | None = None) -> "ModelConfig":
        arch = check_architecture(data)
        if data.get("use_bidirectional_attention"):
            raise ValueError("model: use_bidirectional_attention (an embedding model) is not supported")
        family = FAMILIES[arch]
        eos = data.get("eos_token_id") if eos is None else eos
        kwargs = {k: data[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                       "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "head_dim",
                                       "final_logit_softcapping") if data.get(k) is not None}
        kwargs.setdefault("num_key_value_heads", data["num_attention_heads"])
        if arch == "Gemma3ForCausalLM":
            kwargs.setdefault("tie_word_embeddings", True)
            kwargs["attn_scale"] = float(data.get("query_pre_attn_scalar", 256)) ** -0.5
        bias = bool(data.get("attention_bias", False))
        layer_types, window = _layer_types(arch, data)
        return cls(**kwargs, architecture=arch, torch_dtype=data.get("torch_dtype") or data.get("dtype") or "float32",
                   eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                   qkv_bias=family.get("qkv_bias", bias), o_bias=bias, mlp_bias=bool(data.get("mlp_bias", False)),
                   qk_norm=family.get("qk_norm", False), gemma_norms=family.get("gemma_norms", False),
                   activation=data.get("hidden_activation") or data.get("hidden_act") or "silu",
                   layer_types=layer_types, sliding_window=window, rope=_ropes(arch, data))


def _layer_types(arch: str, data: dict) -> tuple[list[str], int]:
    """Each layer's attention type and the window of the sliding ones, as transformers derives them."""
    n, window = data["num_hidden_layers"], data.get("sliding_window") or 0
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not data.get("use_sliding_window", False):
        window = 0
    types = data.get("layer_types")
    if types is None:
        if arch == "Gemma3ForCausalLM":
            pattern = data.get("sliding_window_pattern", 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        elif arch == "MistralForCausalLM":
            types = [SLIDING if window else FULL] * n
        elif window:
            first = data.get("max_window_layers", n)
            types = [SLIDING if i >= first else FULL for i in range(n)]
        else:
            types = [FULL] * n
    if arch == "MistralForCausalLM" and window:          # Mistral slides every layer when it has a window
        types = [SLIDING] * n
    if not window:
        types = [FULL] * n
    return list(types), window


def _ropes(arch: str, data: dict) -> dict[str, RopeSpec]:
    """RoPE per layer type, from rope_parameters (transformers 5) or rope_theta/rope_scaling (transformers 4)."""
    params = data.get("rope_parameters")
    if arch == "Gemma3ForCausalLM":
        if isinstance(params, dict) and FULL in params:
            return {FULL: RopeSpec.of(params[FULL], 1_000_000.0), SLIDING: RopeSpec.of(params.get(SLIDING), 10_000.0)}
        full = dict(data.get("rope_scaling") or {})
        return {FULL: RopeSpec.of(full, data.get("rope_theta", 1_000_000.0)),
                SLIDING: RopeSpec(float(data.get("rope_local_base_freq", 10_000.0)))}
    if not isinstance(params, dict):
        params = dict(data.get("rope_scaling") or {})
    spec = RopeSpec.of(params, data.get("rope_theta", 10_000.0))
    return {FULL: spec, SLIDING: spec}
