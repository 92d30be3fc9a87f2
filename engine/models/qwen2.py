"""Qwen2 in torch: RMSNorm, fused QKV with bias, RoPE, GQA, fused SwiGLU, tied or untied lm_head.

Tokens of every row in a step are flattened into one [T] batch; attention is delegated to `attn`,
a callable the runner builds per step that writes the new K/V into the cache and attends.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    pointwise = None                  # decode rows: one C call (kernels.cpu_pointwise); see Qwen2.use_kernels

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pointwise is not None and x.shape[0] <= self.pointwise.max_rows:
            return self.pointwise.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # as Hugging Face rounds it: normalise in fp32, round to the model dtype, then scale
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear whose calls of a few rows (decode) go to a GEMV kernel when the runner gives it one."""
    gemv = None                       # Callable (x, weight, bias) -> y with a `max_rows`; see Qwen2.use_gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] <= self.gemv.max_rows:
            return self.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Rope(nn.Module):
    def __init__(self, head_dim: int, max_pos: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        half = head_dim // 2
        self.register_buffer("signed_sin", torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], -1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at each token's position, [T, 1, hd]: once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] = roll(x) with the sign moved into sin."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class Layer(nn.Module):
    kernels = None                    # decode on a CPU: (CpuGemv, CpuPointwise); see Qwen2.use_kernels

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.qkv = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * hd, bias=True)
        self.o_proj = Linear(self.n_heads * hd, cfg.hidden_size, bias=False)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: Attention) -> torch.Tensor:
        # Submodules are called through .forward: nn.Module.__call__ (hooks) costs as much as a small decode op.
        t, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        if self.kernels is not None and t <= self.kernels[0].max_rows:      # decode steps
            return self.fused(idx, x, rope, attn)
        qkv = self.qkv.forward(self.input_norm.forward(x)).view(t, nh + 2 * nkv, self.head_dim)
        qk = Rope.apply(qkv[:, :nh + nkv], *rope)           # q and k heads rotated together
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        x = x + self.o_proj.forward(attn(idx, q, k, v).reshape(t, -1))
        gate, up = self.gate_up.forward(self.post_norm.forward(x)).chunk(2, dim=-1)
        return x + self.down.forward(F.silu(gate) * up)

    def fused(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              attn: Attention) -> torch.Tensor:
        """The same layer in six C calls, each norm, SwiGLU and residual folded into the projection beside it:
        at decode sizes a torch op costs more in dispatch than in arithmetic."""
        gemv, pointwise = self.kernels
        t, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = gemv.fused(x, self.qkv.weight, self.qkv.bias, norm=self.input_norm).view(t, nh + 2 * nkv, -1)
        pointwise.rope(qkv, *rope, heads=nh + nkv)
        x = gemv.fused(attn(idx, qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]).reshape(t, -1),
                       self.o_proj.weight, residual=x)
        gate_up = gemv.fused(x, self.gate_up.weight, norm=self.post_norm)
        return gemv.fused(gate_up, self.down.weight, silu=True, residual=x)


class Qwen2(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_gemv = None
        self.stack = None                 # paged decode on a CPU: every layer in one C call (kernels.cpu_layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        x = F.embedding(ids, self.embed.weight)
        rope = self.rope.tables(positions, x.dtype)
        paged = getattr(attn, "paged", None)          # set on paged decode steps with the CPU attention kernel
        if self.stack is not None and paged is not None and x.shape[0] <= self.stack.max_rows:
            return self.norm.forward(self.stack(x, rope, paged))
        for i, layer in enumerate(self.layers):
            x = layer.forward(i, x, rope, attn)
        return self.norm.forward(x)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_gemv is not None and hidden.shape[0] <= self.head_gemv.max_rows:
            return self.head_gemv(hidden, self.head_weight).float()
        return F.linear(hidden, self.head_weight).float()

    def use_gemv(self, gemv) -> None:
        """Route decode's projections and logits to `gemv` where `gemv.fits(weight)`; None: torch for all."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.gemv = gemv if gemv is not None and gemv.fits(mod.weight) else None
        self.head_gemv = gemv if gemv is not None and gemv.fits(self.head_weight) else None

    def use_kernels(self, gemv, pointwise, stack=None) -> None:
        """Decode's layers (fp32 or bf16) through the fused C calls and the final norm through `pointwise`
        (kernels.cpu_gemv, kernels.cpu_pointwise); paged decode's layers all in one call to `stack`
        (kernels.cpu_layers) where given. None: torch's ops."""
        self.norm.pointwise = pointwise
        self.stack = stack if gemv is not None and pointwise is not None else None
        for layer in self.layers:
            layer.kernels = None if gemv is None or pointwise is None else (gemv, pointwise)
