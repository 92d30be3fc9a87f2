"""The engine's per-position logprobs ({token id: Logprob}) in the OpenAI API's two shapes."""
from __future__ import annotations

from typing import Any

from engine.core.output import Logprob, PositionLogprobs


def completion(positions: list[PositionLogprobs], tokens: list[int], offset: int = 0) -> dict[str, Any]:
    """Legacy completions: parallel lists, top_logprobs keyed by token text (the sampled token and the top ones,
    as vLLM sends them); text_offset is each token's start in the choice's text, from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for position, token in zip(positions, tokens):
        sampled = position[token]
        out["tokens"].append(sampled.decoded_token)
        out["token_logprobs"].append(sampled.logprob)
        out["top_logprobs"].append({lp.decoded_token: lp.logprob for lp in position.values()})
        out["text_offset"].append(offset)
        offset += len(sampled.decoded_token)
    return out


def chat(positions: list[PositionLogprobs], tokens: list[int], top: int) -> dict[str, Any]:
    """Chat: one entry per token, with its `top` most likely alternatives (by rank, as OpenAI defines it)."""
    content = []
    for position, token in zip(positions, tokens):
        best = sorted(position.values(), key=lambda lp: lp.rank)[:top]
        content.append({**_entry(position[token]), "top_logprobs": [_entry(lp) for lp in best]})
    return {"content": content}


def prompt(positions: list[PositionLogprobs | None] | None) -> list[dict[str, dict] | None] | None:
    """vLLM's prompt_logprobs: per prompt token (None for the first), token id -> logprob, rank, decoded_token."""
    if positions is None:
        return None
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in p.items()} for p in positions]


def _entry(lp: Logprob) -> dict[str, Any]:
    return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}


class Shaper:
    """One choice's logprobs, delta by delta: None when the request did not ask; text_offset runs on across a
    stream's chunks."""

    def __init__(self, chat: bool, top: int | None, offset: int = 0) -> None:
        self.chat, self.top, self.offset = chat, top, offset

    def __call__(self, positions: list[PositionLogprobs] | None, tokens: list[int]) -> dict[str, Any] | None:
        if self.top is None or positions is None:
            return None
        if self.chat:
            return chat(positions, tokens, self.top)
        out = completion(positions, tokens, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out
