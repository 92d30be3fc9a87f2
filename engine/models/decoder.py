"""The decoder in torch, every family from one ModelConfig: RMSNorm (or Gemma's), fused QKV with optional biases and
per-head q/k norms, RoPE per layer type, GQA, fused gate/up with SiLU or tanh-GELU, two or four norms a layer,
tied or untied lm_head, an optional final logit softcap.

Tokens of every row in a step are flattened into one [T] batch; attention is delegated to `attn`,
a callable the runner builds per step that writes the new K/V into the cache and attends (sliding layers' windows
are the runner's to apply: it has them from Geometry).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig, RopeSpec

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    pointwise = None                  # decode rows: one C call (kernels.cpu_pointwise); see Decoder.use_kernels

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pointwise is not None and x.dim() == 2 and x.shape[0] <= self.pointwise.max_rows:
            return self.pointwise.rms_norm(x, self.weight, self.eps, self.gemma)
        if self.gemma:                # as Gemma rounds it: normalise and scale by (1 + w) in fp32, then round
            return (F.rms_norm(x.float(), x.shape[-1:], eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # as Llama rounds it: normalise in fp32, round to the model dtype, then scale
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear whose calls of a few rows (decode) go to a GEMV kernel when the runner gives it one."""
    gemv = None                       # Callable (x, weight, bias) -> y with a `max_rows`; see Decoder.use_gemv
    wide = None                       # prefill's F.linear in its stead (models/widen.py); see Decoder.use_wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] <= self.gemv.max_rows:
            return self.gemv(x, self.weight, self.bias)
        return (self.wide or F.linear)(x, self.weight, self.bias)


def inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies, scaled as the spec says (transformers' default, linear and llama3 rules, or
    llama.cpp's per-frequency divisors)."""
    inv = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if spec.divisors:
        inv = inv / torch.tensor(spec.divisors, dtype=torch.float32)
    if spec.kind == "linear":
        return inv / spec.factor
    if spec.kind == "llama3":
        old, lo, hi = spec.original_max_position_embeddings, spec.low_freq_factor, spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / spec.factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, blended, scaled)
    return inv


class Rope(nn.Module):
    """cos and sin of position x inverse frequency, computed for each step's positions: a table over every position
    would hold max_position_embeddings x head_dim x 8 bytes a RoPE (128 MiB for Gemma 3 270M's two)."""

    def __init__(self, head_dim: int, spec: RopeSpec) -> None:
        super().__init__()
        with torch.device("cpu"):         # computed, even where the model is built on the meta device
            self.register_buffer("inv_freq", inv_freq(spec, head_dim), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at each token's position, [T, 1, hd]: once per step, shared by the layers of a type."""
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat([cos, cos], -1).unsqueeze(1).to(dtype),
                torch.cat([-sin, sin], -1).unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] = roll(x) with the sign moved into sin."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def ropes(cfg: ModelConfig) -> nn.ModuleDict:
    """A Rope per layer type; types with the same spec share one (and its tables each step)."""
    made: dict[RopeSpec, Rope] = {}
    return nn.ModuleDict({kind: made.setdefault(spec, Rope(cfg.head_dim, spec))
                          for kind, spec in cfg.rope.items()})


@functools.cache
def scaled_root(hidden: int, dtype: torch.dtype) -> float:
    return torch.tensor(hidden ** 0.5).to(dtype).item()


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Layer(nn.Module):
    kernels = None                    # decode on a CPU: (CpuGemv, CpuPointwise); see Decoder.use_kernels

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd, eps, gemma = cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norms
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.qkv = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.input_norm = RMSNorm(cfg.hidden_size, eps, gemma)
        self.post_norm = RMSNorm(cfg.hidden_size, eps, gemma)            # before the MLP
        self.q_norm = RMSNorm(hd, eps, gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, eps, gemma) if cfg.qk_norm else None
        self.attn_out_norm = RMSNorm(cfg.hidden_size, eps, gemma) if gemma else None   # Gemma's sandwich norms
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, eps, gemma) if gemma else None
        self.act_name = cfg.activation
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: Attention) -> torch.Tensor:
        # Submodules are called through .forward: nn.Module.__call__ (hooks) costs as much as a small decode op.
        t, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        if self.kernels is not None and t <= self.kernels[0].max_rows:      # decode steps
            return self.fused(idx, x, rope, attn)
        qkv = self.qkv.forward(self.input_norm.forward(x)).view(t, nh + 2 * nkv, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm.forward(qkv[:, :nh]), self.k_norm.forward(qkv[:, nh:nh + nkv])], 1)
            qk = Rope.apply(qk, *rope)
        else:
            qk = Rope.apply(qkv[:, :nh + nkv], *rope)           # q and k heads rotated together
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        out = self.o_proj.forward(attn(idx, q, k, v).reshape(t, -1))
        if self.attn_out_norm is not None:
            out = self.attn_out_norm.forward(out)
        x = x + out
        gate, up = self.gate_up.forward(self.post_norm.forward(x)).chunk(2, dim=-1)
        out = self.down.forward(self.act(gate) * up)
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm.forward(out)
        return x + out

    def fused(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              attn: Attention) -> torch.Tensor:
        """The same layer in six C calls (eight or ten with q/k or sandwich norms), each norm, gated activation and
        residual folded into the projection beside it: at decode sizes a torch op costs more in dispatch than in
        arithmetic."""
        gemv, pointwise = self.kernels
        t, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = gemv.fused(x, self.qkv.weight, self.qkv.bias, norm=self.input_norm).view(t, nh + 2 * nkv, -1)
        if self.q_norm is not None:
            pointwise.norm_heads(qkv, self.q_norm, 0, nh)
            pointwise.norm_heads(qkv, self.k_norm, nh, nkv)
        pointwise.rope(qkv, *rope, heads=nh + nkv)
        att = attn(idx, qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]).reshape(t, -1)
        x = self.add(gemv, pointwise, x, self.attn_out_norm, att, self.o_proj)
        gate_up = gemv.fused(x, self.gate_up.weight, self.gate_up.bias, norm=self.post_norm)
        return self.add(gemv, pointwise, x, self.mlp_out_norm, gate_up, self.down, self.act_name)

    @staticmethod
    def add(gemv, pointwise, x: torch.Tensor, norm: RMSNorm | None, inp: torch.Tensor, proj: Linear,
            act: str | None = None) -> torch.Tensor:
        """x + proj(inp), or x + norm(proj(inp)) where the family normalises a block's output (Gemma)."""
        if norm is None:
            return gemv.fused(inp, proj.weight, proj.bias, act=act, residual=x)
        out = gemv.fused(inp, proj.weight, proj.bias, act=act)
        return pointwise.rms_norm(out, norm.weight, norm.eps, norm.gemma, residual=x)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # the weight given, so none is drawn: on the meta device torch's initialisers import torch._dynamo (and triton)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)
        self.ropes = ropes(cfg)
        # the layer types with distinct RoPEs, and each layer's index among them (what cpu_layers takes too)
        specs = list(dict.fromkeys(cfg.rope[kind] for kind in cfg.layer_types))
        self.rope_of = [specs.index(cfg.rope[kind]) for kind in cfg.layer_types]
        self.rope_kinds = [cfg.layer_types[self.rope_of.index(i)] for i in range(len(specs))]
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_gemv = None
        self.wide = None                  # the logits' F.linear in its stead (models/widen.py); see use_wide
        self.stack = None                 # decode on a CPU: every layer in one C call (kernels.cpu_layers)

    def embed_scale(self, dtype: torch.dtype) -> float | None:
        """Gemma's sqrt(hidden_size), rounded to the model dtype first as transformers does."""
        return scaled_root(self.cfg.hidden_size, dtype) if self.cfg.gemma_norms else None

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin tables, computed once per distinct Rope."""
        made = [self.ropes[kind].tables(positions, dtype) for kind in self.rope_kinds]
        return [made[i] for i in self.rope_of]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        x = self.embed.forward(ids)
        scale = self.embed_scale(x.dtype)
        if scale is not None:
            x = x * scale
        tables = self.rope_tables(positions, x.dtype)
        # set on decode steps: paged (with the CPU attention kernel) or dense
        kv = getattr(attn, "paged", None) or getattr(attn, "dense", None)
        if self.stack is not None and kv is not None and x.shape[0] <= self.stack.max_rows:
            return self.norm.forward(self.stack(x, tables, kv))
        for i, layer in enumerate(self.layers):
            x = layer.forward(i, x, tables[i], attn)
        return self.norm.forward(x)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head_weight, nn.Module):           # blocks (models/quant.py)
            out = self.head_weight.forward(hidden)
        elif self.head_gemv is not None and hidden.shape[0] <= self.head_gemv.max_rows:
            out = self.head_gemv(hidden, self.head_weight).float()
        else:
            out = (self.wide or F.linear)(hidden, self.head_weight).float()
        cap = self.cfg.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap

    def use_gemv(self, gemv) -> None:
        """Route decode's projections and logits to `gemv` where `gemv.fits(weight)`; None: torch for all."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.gemv = gemv if gemv is not None and gemv.fits(mod.weight) else None
        head = self.head_weight
        self.head_gemv = gemv if gemv is not None and isinstance(head, torch.Tensor) and gemv.fits(head) else None

    def use_wide(self, linear) -> None:
        """Route the F.linear of every float projection and of the logits to `linear` (models/widen.py); None:
        F.linear."""
        self.wide = linear
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.wide = linear

    def use_kernels(self, gemv, pointwise, stack=None) -> None:
        """Decode's layers (fp32 or bf16) through the fused C calls and the final norm through `pointwise`
        (kernels.cpu_gemv, kernels.cpu_pointwise); decode's layers all in one call to `stack`
        (kernels.cpu_layers) where given. None: torch's ops."""
        on = gemv is not None and pointwise is not None
        self.norm.pointwise = pointwise
        self.stack = stack if on else None
        for layer in self.layers:
            layer.kernels = (gemv, pointwise) if on else None
