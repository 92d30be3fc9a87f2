"""Block pool: ref counts, a free list, and an LRU of freed blocks whose contents stay cached."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class BlockPool:
    """Every block is in exactly one state: free (no content), used (ref > 0) or cached (ref 0, reusable content)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()   # least recently freed first
        self.on_evict: Callable[[int], None] = lambda block: None
        self.is_cached: Callable[[int], bool] = lambda block: False

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.cached)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free) + len(self.cached)

    def allocate(self) -> int:
        """A private block: from the free list, else the least recently used cached block (evicted)."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self.on_evict(block)
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
            if self.is_cached(block):
                self.cached[block] = None
            else:
                self.free.append(block)

    def check_writable(self, block: int) -> None:
        """Only a private block may be written: a shared block is immutable."""
        if self.ref[block] != 1:
            raise RuntimeError(f"write to block {block} with ref count {self.ref[block]}")
