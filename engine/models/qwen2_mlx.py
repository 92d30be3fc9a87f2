"""Qwen2 in MLX, the same flattened-token interface as the torch model: forward(ids, positions, attn) -> hidden."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.models.config import ModelConfig
from engine.models.loader import shard_files

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
Attention = Callable[[int, mx.array, mx.array, mx.array], mx.array]
COMPILED_TOKENS = 16


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
        # Materialize now: lazy loads would otherwise run later on the loading thread's stream.
        mx.eval(self.embed, self.lm_head, self.norm,
                [[getattr(layer, f) for f in Layer.__slots__] for layer in self.layers])
        hd = cfg.head_dim
        self.split = [cfg.num_attention_heads * hd, (cfg.num_attention_heads + cfg.num_key_value_heads) * hd]
        self.attn_in_c, self.attn_out_c = mx.compile(self.attn_in), mx.compile(self.attn_out)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [T, heads, hd], one position per token: each token is its own batch entry with its own offset."""
        return mx.fast.rope(x[:, :, None, :], x.shape[-1], traditional=False, base=self.cfg.rope_theta,
                            scale=1.0, offset=positions)[:, :, 0, :]

    def rms(self, x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def attn_in(self, x: mx.array, positions: mx.array, norm: mx.array, w: mx.array, b: mx.array):
        """Pre-attention half of a layer: norm, fused QKV projection, RoPE; returns q, k, v as [T, heads, hd]."""
        cfg, t = self.cfg, x.shape[0]
        q, k, v = mx.split(mx.addmm(b, self.rms(x, norm), w.T), self.split, axis=-1)
        return (self.rope(q.reshape(t, cfg.num_attention_heads, cfg.head_dim), positions),
                self.rope(k.reshape(t, cfg.num_key_value_heads, cfg.head_dim), positions),
                v.reshape(t, cfg.num_key_value_heads, cfg.head_dim))

    def attn_out(self, x: mx.array, a: mx.array, o_w: mx.array, norm: mx.array, gate_up: mx.array,
                 down: mx.array) -> mx.array:
        """Post-attention half: output projection, residual, norm, SwiGLU MLP, residual."""
        x = x + a.reshape(x.shape[0], -1) @ o_w.T
        gate, up = mx.split(self.rms(x, norm) @ gate_up.T, 2, axis=-1)
        return x + (gate * mx.sigmoid(gate) * up) @ down.T

    def forward(self, ids: mx.array, positions: mx.array, attn: Attention) -> mx.array:
        # Decode-sized steps run the two halves compiled (one graph node each, traced once per token count);
        # prefill lengths vary too much to trace each one.
        small = ids.shape[0] <= COMPILED_TOKENS
        attn_in, attn_out = (self.attn_in_c, self.attn_out_c) if small else (self.attn_in, self.attn_out)
        x = self.embed[ids]
        for i, L in enumerate(self.layers):
            q, k, v = attn_in(x, positions, L.input_norm, L.qkv_w, L.qkv_b)
            x = attn_out(x, attn(i, q, k, v), L.o_w, L.post_norm, L.gate_up, L.down)
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
