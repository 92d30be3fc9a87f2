"""Paged KV: per-request block tables over a shared pool, with prefix adoption from the prompt cache.

A model with sliding-window layers has a table per layer group (engine/kv/layout.py). A sliding group lets go of the
blocks no query can read again, one block behind its window; their table entries stay as they were (stale ids no
kernel reads: attention starts at the window). A prompt-cache hit needs the first group's blocks of the whole prefix
and each sliding group's blocks of its last window only; the longest prefix for which every group has them is
adopted.

A full group gets its blocks for the whole prefill at admission. A sliding group gets them chunk by chunk (`grow`
before each prefill step), so a long prompt never holds more than its window and a chunk there; admission reserves
that much for it (`span`), and nothing else may allocate into the reservations of prefills under way, so a prefill
once admitted always finds its next chunk's blocks."""
from __future__ import annotations

from collections.abc import Callable

from engine.core.request import Request
from engine.kv.block_pool import BlockPool
from engine.kv.layout import Layout, cdiv
from engine.kv.prefix_cache import PrefixCache, root


def contiguity(table: list[int]) -> tuple[int, int]:
    """(adjacent entries, adjacent entries whose ids are consecutive) of one block table."""
    return max(0, len(table) - 1), sum(1 for a, b in zip(table, table[1:]) if b == a + 1)


class PagedKV:
    def __init__(self, pool: BlockPool, cache: PrefixCache | None, copy: Callable[[int, int], None],
                 layout: Layout | None = None, chunk: int = 0) -> None:
        self.pool = pool
        self.cache = cache
        self.copy = copy            # the runner's block copy (src, dst), ordered before the next step's writes
        self.bs = pool.block_size
        self.layout = layout or Layout.of([0])
        self.chunk = chunk          # most prompt tokens a prefill step takes (0: all of it)
        self.filling: dict[int, Request] = {}     # prefills under way that hold reservations
        self.copies = 0             # copy-on-write block copies made

    def span(self, g: int, prefill: int) -> int:
        """The most blocks group g holds during a prefill of `prefill` positions."""
        return self.layout.span(g, prefill, self.bs, self.chunk)

    def fits(self, req: Request) -> bool:
        """Whether the request could ever run: its prefill plus one decode position (each fork: one more block
        for its private tail), in every group, fits an empty pool."""
        need = self.layout.blocks(req.prefill_target + 1, self.bs, self.chunk)
        return need + len(req.forks) * self.layout.groups <= self.pool.num_blocks

    def _reserved(self, skip: Request | None = None) -> int:
        """Blocks the prefills under way (but `skip`) may still take."""
        return sum(max(0, self.span(g, r.prefill_target) - (len(t) - lo))
                   for r in self.filling.values() if r is not skip
                   for g, (t, lo) in enumerate(zip(r.tables, r.slid)) if self.layout.windows[g])

    def admit(self, req: Request) -> bool:
        """Adopt the longest cached prefix and allocate blocks for the rest of the prefill; False if no room."""
        keys = self.cache.match(req.all_ids, req.params.cache_salt) if self.cache and \
            req.params.prompt_logprobs is None else []
        n_adopt, hits = self._hit(keys, min(len(keys), (req.seq_len - 1) // self.bs))
        target, start = req.prefill_target, n_adopt * self.bs
        first = min(target, start + self.chunk) if self.chunk else target      # a sliding group's first chunk
        ends = [cdiv(target if not w else first, self.bs) for w in self.layout.windows]
        needed = sum(end - n_adopt for end in ends)
        filling = first < target and any(self.layout.windows)
        reserve = sum(max(0, self.span(g, target) - (end - lo)) for g, (end, (lo, _)) in enumerate(zip(ends, hits))
                      if self.layout.windows[g]) if filling else 0
        evictable_hits = sum(1 for found in hits for b in found[1] if self.pool.ref[b] == 0)
        if needed + reserve + self._reserved() > self.pool.num_free + self.pool.num_cached - evictable_hits:
            return False
        expected = cdiv(len(req.prompt_ids) + req.params.max_tokens, self.bs) - cdiv(target, self.bs)
        req.tables, req.slid = [], []
        for _, found in hits:               # every group's hits first: a group's allocation may evict another's
            for b in found:
                self.pool.adopt(b)
        for w, end, (lo, found) in zip(self.layout.windows, ends, hits):
            room = max(0, expected) if not w else min(max(0, expected), cdiv(w, self.bs) + 1)
            req.tables.append([found[0] if found else 0] * lo + found +
                              self.pool.allocate_run(end - n_adopt, found[-1] if found else None, room))
            req.slid.append(lo)
        if filling:
            self.filling[req.id] = req
        req.block_keys = keys[:n_adopt]
        req.num_computed = req.num_allocated = n_adopt * self.bs
        return True

    def _hit(self, keys: list, n: int) -> tuple[int, list[tuple[int, list[int]]]]:
        """The most blocks (at most n) of the matched chain `keys` that every group holds what it reads of, and per
        group (its first block read, the cached blocks from there)."""
        layout, bs = self.layout, self.bs
        while True:
            hits = []
            for g in range(layout.groups):
                lo = layout.first_needed(g, n * bs) // bs
                found = [k.block for k in keys[lo:n]] if g == 0 else [self.cache.find(g, k) for k in keys[lo:n]]
                if None in found:
                    break
                hits.append((lo, found))
            else:
                return n, hits
            n -= 1

    def fork(self, src: Request, dst: Request) -> None:
        for table, lo in zip(src.tables, src.slid):
            for b in table[lo:]:
                self.pool.adopt(b)
        dst.tables = [list(t) for t in src.tables]
        dst.slid = list(src.slid)
        dst.block_keys = list(src.block_keys)

    def grow(self, req: Request, positions: int) -> bool:
        """Ensure blocks cover `positions` and the block of the next write is private (a forked sequence's shared
        tail is copied on its first write), in every group; False (nothing allocated) if the pool cannot."""
        at, end = req.num_allocated // self.bs, cdiv(positions, self.bs)
        shared = [at < len(t) and self.pool.ref[t[at]] > 1 for t in req.tables]
        wanted = sum(max(0, end - len(t)) + s for t, s in zip(req.tables, shared))
        if not wanted:
            return True
        if not self.pool.can_allocate(wanted + self._reserved(skip=req)):
            return False
        for table, copy in zip(req.tables, shared):
            if copy:
                block = self.pool.allocate(table[at - 1] if at else None)
                self.copy(table[at], block)
                self.pool.release(table[at])
                table[at] = block
                self.copies += 1
            if end > len(table):
                table.extend(self.pool.allocate_run(end - len(table), table[-1] if table else None))
        return True

    def slots(self, req: Request, start: int, end: int) -> list[int]:
        """Flat cache slots of the first group for positions [start, end), checked writable."""
        return self._slots(req.block_table, start, end)

    def groups(self, req: Request, start: int, end: int) -> list[tuple[list[int], list[int]]]:
        """(slots, block table) of every group past the first, for positions [start, end)."""
        return [(self._slots(t, start, end), t) for t in req.tables[1:]]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs, out = self.bs, []
        for b in range(start // bs, cdiv(end, bs)):
            self.pool.check_writable(table[b])
            lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
            base = table[b] * bs - b * bs
            out.extend(range(base + lo, base + hi))
        return out

    def trim(self, req: Request, positions: int) -> None:
        keep = cdiv(positions, self.bs)
        for table, lo in zip(req.tables, req.slid):
            while len(table) > max(keep, lo):
                self.pool.release(table.pop())

    def commit(self, req: Request) -> None:
        """Register every newly full block of committed KV with the prompt cache (other groups' blocks under the
        first's registrations), then let go of what sliding groups cannot read again."""
        if self.cache is not None:
            ids, bs, keys = None, self.bs, req.block_keys
            for i in range(len(keys), req.num_computed // bs):
                ids = ids or req.all_ids
                parent = keys[-1] if keys else root(req.params.cache_salt)
                keys.append(self.cache.register(req.block_table[i], parent, ids[i * bs:(i + 1) * bs]))
                for g in range(1, len(req.tables)):
                    if i >= req.slid[g]:
                        self.cache.attach(g, keys[-1], req.tables[g][i])
        for g, w in enumerate(self.layout.windows):
            if w:
                self._slide(req, g)
        if not req.prefilling:
            self.filling.pop(req.id, None)

    def _slide(self, req: Request, g: int) -> None:
        """Let go of group g's blocks wholly before its window, one block of slack kept."""
        end = self.layout.first_needed(g, req.num_computed) // self.bs - 1
        table = req.tables[g]
        for i in range(req.slid[g], end):
            self.pool.release(table[i])
        req.slid[g] = max(req.slid[g], end)

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
        """Drop the request's references, tail first (every group's block of a position together), so a chain's
        head is evicted last."""
        for table in req.tables:
            if table:
                self.pool.unhold(table[-1])
        for i in reversed(range(max(map(len, req.tables), default=0))):
            for table, lo in zip(req.tables, req.slid):
                if lo <= i < len(table):
                    self.pool.release(table[i])
        req.tables, req.slid = [], []
        req.block_keys = []
        self.filling.pop(req.id, None)

    def stats(self) -> dict[str, int]:
        return {"free": self.pool.num_free, "used": self.pool.num_used, "cached": self.pool.num_cached}

    def held(self, req: Request) -> int:
        """Blocks the request holds now, every group together."""
        return sum(len(t) - lo for t, lo in zip(req.tables, req.slid))
