"""The decoder in MLX, every family from one ModelConfig (as models/decoder.py), with the same flattened-token
interface as the torch model: forward(ids, positions, attn) -> hidden."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.models import quant_mlx
from engine.models.config import ModelConfig
from engine.models.decoder import inv_freq
from engine.models.loader import shard_files
from engine.models.quant_mlx import Quantized, Weight, fuse, matmul, rows

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
Attention = Callable[[int, mx.array, mx.array, mx.array], mx.array]
COMPILED_TOKENS = 16


def operand(w: mx.array, contiguous: bool) -> mx.array:
    """A checkpoint weight [out, in] as the right operand of `x @ w`: a copy laid out [in, out], or a view.
    The copy is for the CPU. MLX hands fp32 products to cblas_sgemm, and its Linux wheels bundle the reference
    BLAS, whose no-transpose loop (an axpy) runs faster than the dot-product loop that an [out, in]
    weight gets. A GPU keeps the view, the layout mlx-lm's Linear uses."""
    return mx.contiguous(w.T) if contiguous else w.T


NONE = mx.zeros((1,))     # where the family has no such weight (never read: the config says so)


@dataclass(slots=True)
class Layer:
    qkv_w: Weight       # `x @ w` operands [in, out], or a GGUF file's blocks (models/quant_mlx.py)
    qkv_b: mx.array
    o_w: Weight
    gate_up: Weight
    down: Weight
    input_norm: mx.array
    post_norm: mx.array           # before the MLP
    q_norm: mx.array = NONE       # Qwen3, Gemma 3
    k_norm: mx.array = NONE
    attn_out_norm: mx.array = NONE      # Gemma's sandwich norms
    mlp_out_norm: mx.array = NONE
    o_b: mx.array = NONE
    gate_up_b: mx.array = NONE
    down_b: mx.array = NONE


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


class DecoderMLX:
    def __init__(self, cfg: ModelConfig, weights: dict[str, mx.array | Quantized],
                 contiguous: bool | None = None) -> None:
        self.cfg = cfg
        if contiguous is None:
            contiguous = mx.default_device() == mx.cpu
        embed = weights["model.embed_tokens.weight"]
        self.dtype = weights["model.norm.weight"].dtype
        # Tied: one copy serves both, and the embedding lookup takes columns of the head (rows of quantized blocks).
        head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.head = head if isinstance(head, Quantized) else operand(head, contiguous)
        self.embed = None if cfg.tie_word_embeddings and isinstance(embed, mx.array) else embed
        self.norm = self.norm_weight(weights["model.norm.weight"])
        self.layers = [self.layer(cfg, f"model.layers.{i}.", weights, contiguous)
                       for i in range(cfg.num_hidden_layers)]
        hd = cfg.head_dim
        self.qk_width = (cfg.num_attention_heads + cfg.num_key_value_heads) * hd
        specs = list(dict.fromkeys(cfg.rope[kind] for kind in cfg.layer_types))   # layer types may share one
        self.inv_freq = [mx.array(inv_freq(spec, hd).numpy()) for spec in specs]
        self.rope_of = [specs.index(cfg.rope[kind]) for kind in cfg.layer_types]
        self.embed_scale = None
        if cfg.gemma_norms:           # sqrt(hidden_size) rounded to the model dtype, as transformers does
            self.embed_scale = mx.array(np.float32(cfg.hidden_size ** 0.5)).astype(self.dtype)
        # Materialize now: lazy loads would otherwise run later on the loading thread's stream.
        # each layer's weights as the tuple the compiled halves take (mx.compile takes arrays, not a dataclass)
        self.arrays = [tuple(getattr(layer, f) for f in Layer.__slots__) for layer in self.layers]
        mx.eval(self.head, [] if self.embed is None else self.embed, self.norm, self.inv_freq, self.arrays)
        self.attn_in_c, self.attn_out_c = mx.compile(self.attn_in), mx.compile(self.attn_out)

    def norm_weight(self, w: mx.array) -> mx.array:
        """Gemma scales by (1 + w) in fp32: kept that way, so the norm is one fused call."""
        return (1.0 + w.astype(mx.float32)) if self.cfg.gemma_norms else w

    def layer(self, cfg: ModelConfig, p: str, weights: dict[str, mx.array | Quantized], contiguous: bool) -> Layer:
        w = lambda name: weights[p + name]   # noqa: E731
        proj = lambda *names: fuse([w(n + ".weight") for n in names], lambda a: operand(a, contiguous))  # noqa: E731
        norms = (("post_attention_layernorm", "pre_feedforward_layernorm") if cfg.gemma_norms
                 else ("", "post_attention_layernorm"))
        out = Layer(
            qkv_w=proj("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            qkv_b=mx.concatenate([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                  w("self_attn.v_proj.bias")]) if cfg.qkv_bias else NONE,
            o_w=proj("self_attn.o_proj"),
            gate_up=proj("mlp.gate_proj", "mlp.up_proj"),
            down=proj("mlp.down_proj"),
            input_norm=self.norm_weight(w("input_layernorm.weight")),
            post_norm=self.norm_weight(w(norms[1] + ".weight")))
        if cfg.qk_norm:
            out.q_norm = self.norm_weight(w("self_attn.q_norm.weight"))
            out.k_norm = self.norm_weight(w("self_attn.k_norm.weight"))
        if cfg.gemma_norms:
            out.attn_out_norm = self.norm_weight(w(norms[0] + ".weight"))
            out.mlp_out_norm = self.norm_weight(w("post_feedforward_layernorm.weight"))
        if cfg.o_bias:
            out.o_b = w("self_attn.o_proj.bias")
        if cfg.mlp_bias:
            out.gate_up_b = mx.concatenate([w("mlp.gate_proj.bias"), w("mlp.up_proj.bias")])
            out.down_b = w("mlp.down_proj.bias")
        return out

    def rope_tables(self, positions: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Each layer's cos and signed sin [T, 1, 2, hd/2] for the step's positions, made once per distinct RoPE.
        (mx.fast.rope has no CPU kernel: its fallback remade the tables for q and k of every layer.)"""
        made = [self.rope_table(positions, freq) for freq in self.inv_freq]
        return [made[i] for i in self.rope_of]

    def rope_table(self, positions: mx.array, freq: mx.array) -> tuple[mx.array, mx.array]:
        angles = positions.astype(mx.float32)[:, None] * freq
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
        if self.cfg.gemma_norms:
            return mx.fast.rms_norm(x.astype(mx.float32), weight, self.cfg.rms_norm_eps).astype(x.dtype)
        return mx.fast.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def attn_in(self, x: mx.array, cos: mx.array, sin: mx.array, arrays: tuple[mx.array, ...]):
        """Pre-attention half of a layer (its weights as a tuple: what mx.compile takes): norm, fused QKV
        projection, q/k norms, RoPE; returns q, k, v as [T, heads, hd]."""
        cfg, t, nh, L = self.cfg, x.shape[0], self.cfg.num_attention_heads, Layer(*arrays)
        h = self.rms(x, L.input_norm)
        qkv = matmul(h, L.qkv_w, L.qkv_b if cfg.qkv_bias else None)
        qk, v = mx.split(qkv, [self.qk_width], axis=-1)
        qk = qk.reshape(t, -1, cfg.head_dim)
        if cfg.qk_norm:
            qk = mx.concatenate([self.rms(qk[:, :nh], L.q_norm), self.rms(qk[:, nh:], L.k_norm)], axis=1)
        qk = self.rope(qk, cos, sin)
        return qk[:, :nh], qk[:, nh:], v.reshape(t, cfg.num_key_value_heads, cfg.head_dim)

    def attn_out(self, x: mx.array, a: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        """Post-attention half: output projection (and Gemma's norm of it), residual, norm, gated MLP, residual."""
        cfg, L = self.cfg, Layer(*arrays)
        out = matmul(a.reshape(x.shape[0], -1), L.o_w)
        if cfg.o_bias:
            out = out + L.o_b
        if cfg.gemma_norms:
            out = self.rms(out, L.attn_out_norm)
        x = x + out
        gate_up = matmul(self.rms(x, L.post_norm), L.gate_up)
        if cfg.mlp_bias:
            gate_up = gate_up + L.gate_up_b
        gate, up = mx.split(gate_up, 2, axis=-1)
        act = gelu_tanh(gate) if cfg.activation == "gelu_pytorch_tanh" else gate * mx.sigmoid(gate)
        out = matmul(act * up, L.down)
        if cfg.mlp_bias:
            out = out + L.down_b
        if cfg.gemma_norms:
            out = self.rms(out, L.mlp_out_norm)
        return x + out

    def forward(self, ids: mx.array, positions: mx.array, attn: Attention) -> mx.array:
        # Decode-sized steps run the two halves compiled (one graph node each, traced once per token count);
        # prefill lengths vary too much to trace each one.
        small = ids.shape[0] <= COMPILED_TOKENS
        attn_in, attn_out = (self.attn_in_c, self.attn_out_c) if small else (self.attn_in, self.attn_out)
        x = self.head[:, ids].T if self.embed is None else rows(self.embed, ids, self.dtype)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        tables = self.rope_tables(positions)
        for i, arrays in enumerate(self.arrays):
            q, k, v = attn_in(x, *tables[i], arrays)
            x = attn_out(x, attn(i, q, k, v), arrays)
        return self.rms(x, self.norm)

    def logits(self, hidden: mx.array) -> mx.array:
        out = matmul(hidden, self.head).astype(mx.float32)
        cap = self.cfg.final_logit_softcapping
        return out if cap is None else mx.tanh(out / cap) * cap


def load_mlx(path: str | Path, dtype: str = "auto", contiguous: bool | None = None) -> DecoderMLX:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    name = cfg.torch_dtype if dtype == "auto" else dtype
    target = DTYPES.get(name, mx.float32)
    weights: dict[str, mx.array | Quantized] = {}
    if path.suffix == ".gguf":            # exact block types stay quantized, the rest float (models/quant_mlx.py)
        weights = dict(quant_mlx.tensors(path, cfg, target))
    for file in () if path.suffix == ".gguf" else shard_files(path):
        weights.update({k: v.astype(target) for k, v in mx.load(str(file)).items()})
    return DecoderMLX(cfg, weights, contiguous)
