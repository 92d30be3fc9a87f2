"""Prompt cache: a hash-chained index of full KV blocks (paged) and a byte-bounded LRU of donated buffers (dense)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine.kv.block_pool import BlockPool


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class PrefixCache:
    """Maps the hash chain of a full block's tokens to the block holding their KV."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.index: dict[int, int] = {}
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}   # block -> (hash, tokens)
        pool.on_evict = self.forget
        pool.is_cached = self.content.__contains__

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached chain of full blocks that prefixes `tokens`."""
        bs, parent, blocks = self.pool.block_size, 0, []
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


class DenseStore:
    """Finished sequences' dense buffers (tokens + KV), least recently donated evicted first."""

    def __init__(self, max_bytes: int, free: Callable[[int], None]) -> None:
        self.max_bytes = max_bytes
        self.free = free
        self.entries: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()   # buf -> (tokens, bytes)
        self.bytes = 0

    def donate(self, buf: int, tokens: Sequence[int], nbytes: int) -> None:
        if nbytes > self.max_bytes or not tokens:
            self.free(buf)
            return
        while self.bytes + nbytes > self.max_bytes:
            self.evict()
        self.entries[buf] = (tuple(tokens), nbytes)
        self.bytes += nbytes

    def take(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """Remove and return (buf, matched) for the entry sharing the longest prefix with `tokens`."""
        best, best_len = None, 0
        for buf, (stored, _) in self.entries.items():
            n = common_prefix(stored, tokens)
            if n > best_len:
                best, best_len = buf, n
        if best is None:
            return None
        _, nbytes = self.entries.pop(best)
        self.bytes -= nbytes
        return best, best_len

    def evict(self) -> None:
        buf, (_, nbytes) = self.entries.popitem(last=False)
        self.bytes -= nbytes
        self.free(buf)

    def clear(self) -> None:
        while self.entries:
            self.evict()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
