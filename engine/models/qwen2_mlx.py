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


def operand(w: mx.array, contiguous: bool) -> mx.array:
    """A checkpoint weight [out, in] as the right operand of `x @ w`: a copy laid out [in, out], or a view.
    The copy is for the CPU. MLX hands fp32 products to cblas_sgemm, and its Linux wheels bundle the reference
    BLAS, whose no-transpose loop (an axpy) runs faster than the dot-product loop that an [out, in]
    weight gets. A GPU keeps the view, the layout mlx-lm's Linear uses."""
    return mx.contiguous(w.T) if contiguous else w.T


@dataclass(slots=True)
class Layer:
    qkv_w: mx.array     # weights are `x @ w` operands, [in, out]
    qkv_b: mx.array
    o_w: mx.array
    gate_up: mx.array
    down: mx.array
    input_norm: mx.array
    post_norm: mx.array


class Qwen2MLX:
    def __init__(self, cfg: ModelConfig, weights: dict[str, mx.array], contiguous: bool | None = None) -> None:
        self.cfg = cfg
        if contiguous is None:
            contiguous = mx.default_device() == mx.cpu
        embed = weights["model.embed_tokens.weight"]
        self.dtype = embed.dtype
        # Tied: one copy serves both, and the embedding lookup takes columns of the head.
        self.head = operand(embed if cfg.tie_word_embeddings else weights["lm_head.weight"], contiguous)
        self.embed = None if cfg.tie_word_embeddings else embed
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            w = lambda name: weights[p + name]   # noqa: E731
            self.layers.append(Layer(
                qkv_w=operand(mx.concatenate([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                                              w("self_attn.v_proj.weight")]), contiguous),
                qkv_b=mx.concatenate([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                      w("self_attn.v_proj.bias")]),
                o_w=operand(w("self_attn.o_proj.weight"), contiguous),
                gate_up=operand(mx.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), contiguous),
                down=operand(w("mlp.down_proj.weight"), contiguous), input_norm=w("input_layernorm.weight"),
                post_norm=w("post_attention_layernorm.weight")))
        hd = cfg.head_dim
        self.qk_width = (cfg.num_attention_heads + cfg.num_key_value_heads) * hd
        self.inv_freq = cfg.rope_theta ** (-mx.arange(0, hd, 2, dtype=mx.float32) / hd)
        # Materialize now: lazy loads would otherwise run later on the loading thread's stream.
        mx.eval(self.head, [] if self.embed is None else self.embed, self.norm, self.inv_freq,
                [[getattr(layer, f) for f in Layer.__slots__] for layer in self.layers])
        self.attn_in_c, self.attn_out_c = mx.compile(self.attn_in), mx.compile(self.attn_out)

    def rope_tables(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """cos and signed sin [T, 1, 2, hd/2] for the step's positions, made once and shared by every layer.
        (mx.fast.rope has no CPU kernel: its fallback remade the tables for q and k of every layer.)"""
        angles = positions.astype(mx.float32)[:, None] * self.inv_freq
        cos, sin = mx.cos(angles)[:, None, None, :], mx.sin(angles)[:, None, None, :]
        return cos.astype(self.dtype), mx.concatenate([-sin, sin], axis=2).astype(self.dtype)

    @staticmethod
    def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """x [T, heads, hd] viewed as halves [T, heads, 2, hd/2]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
        The half swap is a reversed view, so the whole rotation is one fused elementwise op under mx.compile."""
        t, h, hd = x.shape
        halves = x.reshape(t, h, 2, hd // 2)
        return (halves * cos + halves[:, :, ::-1, :] * sin).reshape(t, h, hd)

    def rms(self, x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def attn_in(self, x: mx.array, cos: mx.array, sin: mx.array, norm: mx.array, w: mx.array, b: mx.array):
        """Pre-attention half of a layer: norm, fused QKV projection, RoPE; returns q, k, v as [T, heads, hd]."""
        cfg, t = self.cfg, x.shape[0]
        qk, v = mx.split(mx.addmm(b, self.rms(x, norm), w), [self.qk_width], axis=-1)
        qk = self.rope(qk.reshape(t, -1, cfg.head_dim), cos, sin)
        return (qk[:, :cfg.num_attention_heads], qk[:, cfg.num_attention_heads:],
                v.reshape(t, cfg.num_key_value_heads, cfg.head_dim))

    def attn_out(self, x: mx.array, a: mx.array, o_w: mx.array, norm: mx.array, gate_up: mx.array,
                 down: mx.array) -> mx.array:
        """Post-attention half: output projection, residual, norm, SwiGLU MLP, residual."""
        x = x + a.reshape(x.shape[0], -1) @ o_w
        gate, up = mx.split(self.rms(x, norm) @ gate_up, 2, axis=-1)
        return x + (gate * mx.sigmoid(gate) * up) @ down

    def forward(self, ids: mx.array, positions: mx.array, attn: Attention) -> mx.array:
        # Decode-sized steps run the two halves compiled (one graph node each, traced once per token count);
        # prefill lengths vary too much to trace each one.
        small = ids.shape[0] <= COMPILED_TOKENS
        attn_in, attn_out = (self.attn_in_c, self.attn_out_c) if small else (self.attn_in, self.attn_out)
        x = self.head[:, ids].T if self.embed is None else self.embed[ids]
        cos, sin = self.rope_tables(positions)
        for i, L in enumerate(self.layers):
            q, k, v = attn_in(x, cos, sin, L.input_norm, L.qkv_w, L.qkv_b)
            x = attn_out(x, attn(i, q, k, v), L.o_w, L.post_norm, L.gate_up, L.down)
        return self.rms(x, self.norm)

    def logits(self, hidden: mx.array) -> mx.array:
        return (hidden @ self.head).astype(mx.float32)


def load_mlx(path: str | Path, dtype: str = "auto", contiguous: bool | None = None) -> Qwen2MLX:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    name = cfg.torch_dtype if dtype == "auto" else dtype
    target = DTYPES.get(name, mx.float32)
    weights: dict[str, mx.array] = {}
    for file in shard_files(path):
        weights.update({k: v.astype(target) for k, v in mx.load(str(file)).items()})
    return Qwen2MLX(cfg, weights, contiguous)
