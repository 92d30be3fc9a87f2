"""Random-weight checkpoints made locally, in exactly the Hugging Face layout, at each family's real geometry and
tiny ones for tests: Qwen2 (tiny, small with a tokenizer trained here; tiny-qwen, qwen2.5-0.5b with Qwen2.5's
own tokenizer), Llama 3.2, Qwen3, Gemma 3, SmolLM2 (Llama's architecture) and Mistral. Where the family's
tokenizer can be had offline (preset_tokenizers) they carry it, so they are that model in all but the weights."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import cache_root
from engine.models import preset_tokenizers
from engine.models.config import ModelConfig

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    "tiny-odd": dict(vocab_size=1024, hidden_size=84, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=7, num_key_value_heads=1, max_position_embeddings=4096,
                     tie_word_embeddings=True),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                  tie_word_embeddings=True),
    "tiny-qwen": dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, torch_dtype="bfloat16"),
    # the other families, at their real geometries, and tiny ones for tests
    "llama3.2-1b": dict(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        max_position_embeddings=131072, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen3-0.6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "gemma3-270m": dict(family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        max_position_embeddings=32768, sliding_window=512, torch_dtype="bfloat16"),
    "smollm2-135m": dict(family="smollm2", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "tiny-llama": dict(family="llama", vocab_size=128256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=16384, tie_word_embeddings=True),
    "tiny-qwen3": dict(family="qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=4096, tie_word_embeddings=True),
    "tiny-gemma3": dict(family="gemma3", vocab_size=1024, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        max_position_embeddings=4096, sliding_window=48, sliding_window_pattern=3),
    "tiny-mistral": dict(family="mistral", vocab_size=1024, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, sliding_window=40),
}
# config.json per family, beside the geometry (transformers 4's layout, which transformers 5 reads too)
FAMILY_CONFIG: dict[str, dict] = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rope_theta=1e6,
                  use_sliding_window=False, sliding_window=None),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192),
                  attention_bias=False, mlp_bias=False),
    "smollm2": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rope_theta=100000.0,
                    attention_bias=False, mlp_bias=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu",
                    rope_theta=1e6),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", rope_theta=1e6,
                  attention_bias=False, use_sliding_window=False, sliding_window=None),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   hidden_activation="gelu_pytorch_tanh", rope_theta=1e6, rope_local_base_freq=10000.0,
                   query_pre_attn_scalar=256, attention_bias=False, final_logit_softcapping=None,
                   tie_word_embeddings=True),
}


def hf_config(preset: str, eos: list[int], bos: int | None) -> dict:
    spec = dict(PRESETS[preset])
    family = spec.pop("family", "qwen2")
    pattern = spec.pop("sliding_window_pattern", 6)
    data = {**FAMILY_CONFIG[family], **spec, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "bos_token_id": bos, "rms_norm_eps": 1e-6, "initializer_range": 0.02, "use_cache": True,
            "attention_dropout": 0.0}
    data.setdefault("torch_dtype", "float32")
    if family == "gemma3":
        data["query_pre_attn_scalar"] = data["head_dim"]
        data["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                               for i in range(data["num_hidden_layers"])]
    return data


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    def norm(n: int) -> torch.Tensor:           # Gemma scales by 1 + w
        return (torch.zeros if cfg.gemma_norms else torch.ones)(n, dtype=dtype)

    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    w = {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "model.norm.weight": norm(h)}
    norms = (["input_layernorm", "post_attention_layernorm"]
             + (["pre_feedforward_layernorm", "post_feedforward_layernorm"] if cfg.gemma_norms else []))
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, h)
            if cfg.qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(rows)
        w.update({p + "self_attn.o_proj.weight": normal(h, q), p + "mlp.gate_proj.weight": normal(i, h),
                  p + "mlp.up_proj.weight": normal(i, h), p + "mlp.down_proj.weight": normal(h, i)})
        w.update({p + name + ".weight": norm(h) for name in norms})
        if cfg.qk_norm:
            w.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = normal(cfg.vocab_size, h)
    return w


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def make_model(preset: str, out: str | Path, seed: int = 0) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"preset: must be one of {', '.join(PRESETS)}, got {preset!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = PRESETS[preset]
    made = preset_tokenizers.for_preset(spec.get("family", "qwen2"), spec["vocab_size"])
    config = hf_config(preset, made.eos, made.bos)
    cfg = ModelConfig.from_hf(config)
    made.tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {**made.config, "model_max_length": cfg.max_position_embeddings})
    _write_json(out / "config.json", config)
    pad = made.tok.token_to_id("<|endoftext|>")
    _write_json(out / "generation_config.json", {"eos_token_id": made.eos, "bos_token_id": made.bos,
                                                 **({"pad_token_id": pad} if pad is not None else {})})
    dtype = getattr(torch, cfg.torch_dtype)
    save_file(random_weights(cfg, seed, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cached_model(preset: str = "small", seed: int = 0) -> Path:
    """The preset under the cache folder (cache_root()), made on first use."""
    root = cache_root()
    path = root / "models" / f"{preset}-seed{seed}"
    if (path / "model.safetensors").exists():
        return path
    root.joinpath("models").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root / "models", prefix=f".{preset}-"))
    try:
        make_model(preset, tmp, seed)
        tmp.chmod(0o755)
        tmp.rename(path)
    except OSError:
        if not (path / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
