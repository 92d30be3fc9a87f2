"""Block pool: ref counts, a free map, and an LRU of freed blocks whose contents stay cached.

Allocation keeps a sequence's blocks contiguous where it can. A new table starts at the lowest run of free blocks
long enough for its prefill plus the room it expects to grow into (its headroom, held); a growing table takes the
block after its last one when that is free or held, else the lowest free block. Other tables take held blocks
only when nothing else is free. Consecutive ids read the cache in long runs (the paged kernels' loads and the CPU
gather both like that), and a prompt-cache hit's fresh tail lands next to its adopted prefix instead of wherever
the last release left a block.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

TAKEN, FREE, HELD = 0, 1, 2         # free-map states; HELD: free, kept as headroom after a table's last block


class BlockIndex(Protocol):
    """What the pool asks of the prompt cache (PrefixCache): does a block hold cached content, and forget it."""
    def __contains__(self, block: int) -> bool: ...
    def forget(self, block: int) -> None: ...


class BlockPool:
    """Every block is in exactly one state: free (no content), used (ref > 0) or cached (ref 0, reusable content)."""

    def __init__(self, num_blocks: int, block_size: int, contiguous: bool = True,
                 index: BlockIndex | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.contiguous = contiguous    # False: the free block released longest ago (release order)
        self.ref = [0] * num_blocks
        self.map = bytearray([FREE]) * num_blocks     # one byte per block: run searches are bytes.find, in C
        self.num_free = num_blocks                    # FREE or HELD
        self.released = deque([] if contiguous else range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()   # least recently freed first
        self.index = index              # a freed block it holds stays cached; an evicted one leaves it

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - len(self.cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free + len(self.cached)

    def allocate_run(self, n: int, after: int | None = None, headroom: int = 0) -> list[int]:
        """n private blocks for a table that ends with `after` (None: a new table expecting `headroom` more)."""
        if n <= 0:
            return []
        if self.contiguous and (after is None or not self._is_open(after + 1)):
            start = self.map.find(bytes([FREE]) * (n + headroom))
            if start < 0:
                start, headroom = self.map.find(bytes([FREE]) * n), 0
            if start >= 0:
                after = start - 1
                self.map[start + n:start + n + headroom] = bytes([HELD]) * headroom
        out = []
        for _ in range(n):
            out.append(self.allocate(after))
            after = out[-1]
        return out

    def allocate(self, after: int | None = None) -> int:
        """A private block: the one after `after` if free, else the lowest free block; with none free, a cached
        block is evicted: the one after `after` if it is cached, else the least recently used."""
        if self.num_free:
            block = self._pick_free(after)
            self.map[block] = TAKEN
            self.num_free -= 1
        elif self.cached:
            block = after + 1 if self.contiguous and after is not None and after + 1 in self.cached else None
            if block is None:
                block, _ = self.cached.popitem(last=False)
            else:
                del self.cached[block]                     # the next block of this table's run: keeps it contiguous
            self.index.forget(block)
        else:
            raise MemoryError("KV block pool exhausted")
        self.ref[block] = 1
        return block

    def adopt(self, block: int) -> None:
        """Take one more reference to a block that holds cached content."""
        if self.ref[block] == 0:
            del self.cached[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise RuntimeError(f"block {block} released with ref count {self.ref[block]}")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.index is not None and block in self.index:
                self.cached[block] = None
            else:
                self.map[block] = FREE
                self.num_free += 1
                if not self.contiguous:
                    self.released.append(block)

    def unhold(self, last: int) -> None:
        """A table that ended with block `last` is gone: its headroom is plain free space again."""
        block = last + 1
        while block < self.num_blocks and self.map[block] == HELD:
            self.map[block] = FREE
            block += 1

    def _is_open(self, block: int) -> bool:
        return block < self.num_blocks and self.map[block] != TAKEN

    def _pick_free(self, after: int | None) -> int:
        if not self.contiguous:
            return self.released.popleft()
        if after is not None and self._is_open(after + 1):
            return after + 1
        block = self.map.find(bytes([FREE]))
        return block if block >= 0 else self.map.find(bytes([HELD]))

    def check_writable(self, block: int) -> None:
        """Only a private block may be written: a shared block is immutable."""
        if self.ref[block] != 1:
            raise RuntimeError(f"write to block {block} with ref count {self.ref[block]}")
