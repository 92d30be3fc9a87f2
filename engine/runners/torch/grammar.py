"""The structured-output mask on the device: each constrained row's matcher fills its row of xgrammar's token bitmask
on the host, at the last moment (under lookahead, after the previous step's tokens were committed), and xgrammar's
kernel sets the disallowed logits to -inf before anything else reads them, as vLLM's model runner does."""
from __future__ import annotations

import torch

from engine.runners.base import Row


def constrain(logits: torch.Tensor, rows: list[Row], vocab_size: int) -> None:
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return
    import xgrammar as xgr  # only once a request asks for structured output
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for i in constrained:
        rows[i].grammar.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size,
                                    indices=constrained)
