"""Prompts for hit vs miss measurements, as token ids so their lengths and shared prefixes are exact.

A MISS prompt starts with a fresh nonce: within one workload no two prompts share a first token, so none
shares a first block (paged) or any prefix (dense). Workloads that run against one server draw their first tokens
from disjoint `first` ranges, so that holds across them too (dense storage adopts a prefix of any length).
A HIT prompt repeats an earlier prompt but for its last
`suffix` tokens, so a 471-token prompt adopts 448 tokens on paged storage with 32-token blocks.
"""
from __future__ import annotations

import random
import time

NONCE = 8


class Workload:
    def __init__(self, prompt_tokens: int, suffix: int = 23, seed: int | None = None,
                 low: int = 3, high: int = 900, first: range | None = None) -> None:
        if not 0 < suffix < prompt_tokens:
            raise ValueError(f"suffix: must be in (0, prompt_tokens={prompt_tokens}), got {suffix}")
        if prompt_tokens <= NONCE:
            raise ValueError(f"prompt_tokens: must exceed the {NONCE}-token nonce, got {prompt_tokens}")
        self.prompt_tokens, self.suffix = prompt_tokens, suffix
        self.low, self.high = low, high
        self.first = first or range(low, high)
        self.rng = random.Random(time.time_ns() if seed is None else seed)
        self.body = self._ids(prompt_tokens - NONCE)     # shared by every MISS prompt, after its nonce
        self.first_tokens: set[int] = set()

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.low, self.high) for _ in range(n)]

    def miss(self) -> list[int]:
        if len(self.first_tokens) >= len(self.first):
            raise RuntimeError("workload: out of distinct first tokens")
        while True:
            nonce = self._ids(NONCE)
            nonce[0] = self.rng.choice(self.first)
            if nonce[0] not in self.first_tokens:
                self.first_tokens.add(nonce[0])
                return nonce + self.body

    def hit(self, earlier: list[int]) -> list[int]:
        keep = self.prompt_tokens - self.suffix
        tail = self._ids(self.suffix)
        while keep < len(earlier) and tail[0] == earlier[keep]:
            tail[0] = self.rng.randrange(self.low, self.high)
        return earlier[:keep] + tail
