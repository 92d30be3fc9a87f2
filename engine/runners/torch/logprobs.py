"""Logprobs on the device, computed in the step that samples and read back with its tokens, so lookahead keeps
overlapping. As vLLM's default (logprobs_mode raw_logprobs), they are the log-softmax of the model's logits before
any processing: no bias, penalty, min_tokens ban, temperature, top-k or top-p. A structured-output mask is the one
thing applied before them, as in vLLM, whose model runner masks the logits before its sampler sees them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runners.base import PickedLogprobs, Row


@dataclass(slots=True)
class DeviceLogprobs(PickedLogprobs):
    def to_host(self) -> DeviceLogprobs:
        """Pinned copies queued on the current stream (CUDA); the caller's event marks them ready."""
        values = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
        ids = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
        values.copy_(self.values, non_blocking=True)
        ids.copy_(self.ids, non_blocking=True)
        return DeviceLogprobs(self.rows, self.ks, values, ids)


def prompt(logits: torch.Tensor, row: Row) -> DeviceLogprobs:
    """A prefill row's prompt logprobs: at each position, the next prompt token's logprob and rank, and the top
    `row.prompt_logprobs` (its last position only when the prompt goes on past the row)."""
    targets = [*row.tokens[1:], *([row.next_token] if row.next_token >= 0 else [])]
    n = len(targets)
    return pick(torch.log_softmax(logits[:n], dim=-1), torch.tensor(targets, device=logits.device), list(range(n)),
                [row.prompt_logprobs] * n)


def raw(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[n, V] log-softmax of the asking rows' logits; take it before anything changes the logits in place."""
    return torch.log_softmax(logits[rows], dim=-1)


def pick(logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int]) -> DeviceLogprobs:
    """The sampled tokens' logprobs and ranks, and the top max(ks) of each row, all still on the device."""
    sampled = logprobs.gather(1, tokens[:, None])                              # [n, 1]
    rank = (logprobs > sampled).sum(dim=1, keepdim=True) + 1
    top = logprobs.topk(max(ks), dim=-1)
    return DeviceLogprobs(rows, ks, torch.cat([sampled, top.values], 1), torch.cat([rank, top.indices], 1))
