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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Rope(nn.Module):
    def __init__(self, head_dim: int, max_pos: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each token's position, [T, 1, hd]: once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.qkv = nn.Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: Attention) -> torch.Tensor:
        t, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = self.qkv(self.input_norm(x)).view(t, nh + 2 * nkv, self.head_dim)
        qk = Rope.apply(qkv[:, :nh + nkv], *rope)           # q and k heads rotated together
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        x = x + self.o_proj(attn(idx, q, k, v).reshape(t, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Qwen2(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        x = self.embed(ids)
        rope = self.rope.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, rope, attn)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
