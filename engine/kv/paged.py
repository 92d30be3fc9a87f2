"""Paged KV: per-request block tables over a shared pool, with prefix adoption from the prompt cache."""
from __future__ import annotations

from collections.abc import Callable

from engine.core.request import Request
from engine.kv.block_pool import BlockPool
from engine.kv.prefix_cache import PrefixCache, root


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def contiguity(table: list[int]) -> tuple[int, int]:
    """(adjacent entries, adjacent entries whose ids are consecutive) of one block table."""
    return max(0, len(table) - 1), sum(1 for a, b in zip(table, table[1:]) if b == a + 1)


class PagedKV:
    def __init__(self, pool: BlockPool, cache: PrefixCache | None, copy: Callable[[int, int], None]) -> None:
        self.pool = pool
        self.cache = cache
        self.copy = copy            # the runner's block copy (src, dst), ordered before the next step's writes
        self.bs = pool.block_size
        self.copies = 0             # copy-on-write block copies made

    def fits(self, req: Request) -> bool:
        """Whether the request could ever run: its prefill plus one decode position (each fork: one more block
        for its private tail) fits an empty pool."""
        return cdiv(req.prefill_target + 1, self.bs) + len(req.forks) <= self.pool.num_blocks

    def admit(self, req: Request) -> bool:
        """Adopt the longest cached prefix and allocate blocks for the rest of the prefill; False if no room."""
        keys = self.cache.match(req.all_ids, req.params.cache_salt) if self.cache and \
            req.params.prompt_logprobs is None else []
        n_adopt = min(len(keys), (req.seq_len - 1) // self.bs)
        keys = keys[:n_adopt]
        hits = [k.block for k in keys]
        needed = cdiv(req.prefill_target, self.bs) - n_adopt
        evictable_hits = sum(1 for b in hits if self.pool.ref[b] == 0)
        if needed > self.pool.num_free + self.pool.num_cached - evictable_hits:
            return False
        for b in hits:
            self.pool.adopt(b)
        expected = cdiv(len(req.prompt_ids) + req.params.max_tokens, self.bs) - n_adopt - needed
        req.block_table = hits + self.pool.allocate_run(needed, hits[-1] if hits else None, max(0, expected))
        req.block_keys = keys
        req.num_computed = req.num_allocated = n_adopt * self.bs
        return True

    def fork(self, src: Request, dst: Request) -> None:
        for b in src.block_table:
            self.pool.adopt(b)
        dst.block_table = list(src.block_table)
        dst.block_keys = list(src.block_keys)

    def grow(self, req: Request, positions: int) -> bool:
        """Ensure blocks cover `positions` and the block of the next write is private (a forked sequence's shared
        tail is copied on its first write); False (nothing allocated) if the pool cannot."""
        table = req.block_table
        at = req.num_allocated // self.bs
        shared = at < len(table) and self.pool.ref[table[at]] > 1
        needed = cdiv(positions, self.bs) - len(table)
        if needed <= 0 and not shared:
            return True
        if not self.pool.can_allocate(max(0, needed) + shared):
            return False
        if shared:
            block = self.pool.allocate(table[at - 1] if at else None)
            self.copy(table[at], block)
            self.pool.release(table[at])
            table[at] = block
            self.copies += 1
        if needed > 0:
            table.extend(self.pool.allocate_run(needed, table[-1] if table else None))
        return True

    def slots(self, req: Request, start: int, end: int) -> list[int]:
        """Flat cache slots for positions [start, end), checked writable."""
        table, bs, out = req.block_table, self.bs, []
        for b in range(start // bs, cdiv(end, bs)):
            self.pool.check_writable(table[b])
            lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
            base = table[b] * bs - b * bs
            out.extend(range(base + lo, base + hi))
        return out

    def trim(self, req: Request, positions: int) -> None:
        keep = cdiv(positions, self.bs)
        while len(req.block_table) > keep:
            self.pool.release(req.block_table.pop())

    def commit(self, req: Request) -> None:
        """Register every newly full block of committed KV with the prompt cache."""
        if self.cache is None:
            return
        ids, bs, keys = None, self.bs, req.block_keys
        for i in range(len(keys), req.num_computed // bs):
            ids = ids or req.all_ids
            parent = keys[-1] if keys else root(req.params.cache_salt)
            keys.append(self.cache.register(req.block_table[i], parent, ids[i * bs:(i + 1) * bs]))

    def announce(self, req: Request, end: int) -> None:
        """KV events: promise the blocks a prefill up to position `end` will fill (PrefixCache.promise)."""
        if self.cache is None or self.cache.events is None:
            return
        keys, bs, ids = req.block_keys, self.bs, req.all_ids
        up = self.cache.content[keys[-1].block].digest if keys else None
        for i in range(len(keys), end // bs):
            up = self.cache.promise(up, req.params.cache_salt, ids[i * bs:(i + 1) * bs])

    def withdraw(self) -> None:
        """A step failed: take back its promises."""
        if self.cache is not None and self.cache.events is not None:
            self.cache.withdraw()

    def release(self, req: Request) -> None:
        """Drop the request's references, tail first, so a chain's head is evicted last."""
        if req.block_table:
            self.pool.unhold(req.block_table[-1])
        for b in reversed(req.block_table):
            self.pool.release(b)
        req.block_table = []
        req.block_keys = []

    def stats(self) -> dict[str, int]:
        return {"free": self.pool.num_free, "used": self.pool.num_used, "cached": self.pool.num_cached}
