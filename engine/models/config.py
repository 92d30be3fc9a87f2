"""ModelConfig: the geometry of a Qwen2 checkpoint, read from and written to Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED = ("Qwen2ForCausalLM",)


def check_architecture(data: dict) -> None:
    """Refuse, by name and before any weight is read, a checkpoint whose architecture this engine does not run."""
    names = data.get("architectures") or []
    if names:
        if not any(n in SUPPORTED for n in names):
            raise ValueError(f"model: architecture {names[0]!r} is not supported (supported: {', '.join(SUPPORTED)})")
    elif data.get("model_type") != "qwen2":
        raise ValueError(f"model: model_type {data.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json (it takes a Hugging Face Qwen2 directory)")
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
        check_architecture(data)
        eos = data.get("eos_token_id")
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id", eos)
        names = cls.__slots__
        kwargs = {k: data[k] for k in names if k in data and k != "eos_token_id"}
        kwargs["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if "rope_theta" not in data and isinstance(data.get("rope_parameters"), dict):
            kwargs["rope_theta"] = data["rope_parameters"].get("rope_theta", 1_000_000.0)
        kwargs["torch_dtype"] = data.get("torch_dtype") or data.get("dtype") or "float32"
        return cls(**kwargs)

    def to_hf(self) -> dict:
        data = asdict(self)
        data["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        data.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                    attention_dropout=0.0, initializer_range=0.02, use_cache=True,
                    use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        return data
