"""Qwen2 in MLX, the same flattened-token interface as the torch model: forward(ids, positions, attn) -> hidden."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.models.config import ModelConfig
from engine.models.loader import shard_files

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
Attention = Callable[[int, mx.array, mx.array, mx.array], mx.array]


@dataclass(slots=True)
class Layer:
    qkv_w: mx.array
    qkv_b: mx.array
    o_w: mx.array
    gate_up: mx.array
    down: mx.array
    input_norm: mx.array
    post_norm: mx.array


class Qwen2MLX:
    def __init__(self, cfg: ModelConfig, weights: dict[str, mx.array]) -> None:
        self.cfg = cfg
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            w = lambda name: weights[p + name]   # noqa: E731
            self.layers.append(Layer(
                qkv_w=mx.concatenate([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                                      w("self_attn.v_proj.weight")]),
                qkv_b=mx.concatenate([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                      w("self_attn.v_proj.bias")]),
                o_w=w("self_attn.o_proj.weight"),
                gate_up=mx.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
                down=w("mlp.down_proj.weight"), input_norm=w("input_layernorm.weight"),
                post_norm=w("post_attention_layernorm.weight")))
        hd = cfg.head_dim
        inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))
        freqs = np.outer(np.arange(cfg.max_position_embeddings, dtype=np.float32), inv.astype(np.float32))
        emb = np.concatenate([freqs, freqs], axis=-1)
        self.cos, self.sin = mx.array(np.cos(emb)), mx.array(np.sin(emb))
        # Materialize now: lazy loads would otherwise run later on the loading thread's stream.
        mx.eval(self.embed, self.lm_head, self.norm, self.cos, self.sin,
                [[getattr(layer, f) for f in Layer.__slots__] for layer in self.layers])
        self.split = [cfg.num_attention_heads * hd, (cfg.num_attention_heads + cfg.num_key_value_heads) * hd]

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        cos = self.cos[positions][:, None, :].astype(x.dtype)
        sin = self.sin[positions][:, None, :].astype(x.dtype)
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def rms(self, x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def forward(self, ids: mx.array, positions: mx.array, attn: Attention) -> mx.array:
        cfg, t = self.cfg, ids.shape[0]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = self.embed[ids]
        for i, L in enumerate(self.layers):
            qkv = self.rms(x, L.input_norm) @ L.qkv_w.T + L.qkv_b
            q, k, v = mx.split(qkv, self.split, axis=-1)
            q = self.rope(q.reshape(t, nh, hd), positions)
            k = self.rope(k.reshape(t, nkv, hd), positions)
            x = x + attn(i, q, k, v.reshape(t, nkv, hd)).reshape(t, -1) @ L.o_w.T
            gate, up = mx.split(self.rms(x, L.post_norm) @ L.gate_up.T, 2, axis=-1)
            x = x + (gate * mx.sigmoid(gate) * up) @ L.down.T
        return self.rms(x, self.norm)

    def logits(self, hidden: mx.array) -> mx.array:
        return (hidden @ self.lm_head.T).astype(mx.float32)


def load_mlx(path: str | Path, dtype: str = "auto") -> Qwen2MLX:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    name = cfg.torch_dtype if dtype == "auto" else dtype
    target = DTYPES.get(name, mx.float32)
    weights: dict[str, mx.array] = {}
    for file in shard_files(path):
        weights.update({k: v.astype(target) for k, v in mx.load(str(file)).items()})
    return Qwen2MLX(cfg, weights)
