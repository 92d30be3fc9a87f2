"""The prompt cache of paged KV: a hash-chained index of full blocks, exact on tokens.

A block is found only if its tokens and its whole parent chain match, whatever the hash does. The block pool
asks the index whether a freed block holds cached content (then it stays reusable) and tells it when it
evicts one.
"""
from __future__ import annotations

from collections.abc import Sequence


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class PrefixCache:
    """Maps the hash chain of a full block's tokens to the block holding their KV."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.index: dict[int, int] = {}
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}   # block -> (hash, tokens)

    def __contains__(self, block: int) -> bool:
        return block in self.content

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached chain of full blocks that prefixes `tokens`."""
        bs, parent, blocks = self.block_size, 0, []
        for start in range(0, len(tokens) - bs + 1, bs):
            chunk = tuple(tokens[start:start + bs])
            h = block_hash(parent, chunk)
            block = self.index.get(h)
            if block is None or self.content[block][1] != chunk:
                break
            blocks.append(block)
            parent = h
        return blocks

    def register(self, block: int, h: int, tokens: Sequence[int]) -> None:
        if h in self.index or block in self.content:
            return      # the same content is already cached in another block
        self.index[h] = block
        self.content[block] = (h, tuple(tokens))

    def forget(self, block: int) -> None:
        h, _ = self.content.pop(block)
        del self.index[h]
