"""Property tests (hypothesis): random sequences of admissions, prefills, decode steps, unwinds and releases on a
small paged pool with a prompt cache. After every operation the bookkeeping must hold: ref counts match the tables
that name each block, free + used + cached = total, the free map agrees with the counts, every cached hash maps to
a block that really holds those tokens (no stale mapping after a block is reused), and no shared block is ever
written (PagedKV.slots checks every slot it hands out). Forks (parallel sampling) share a sequence's blocks and
copy the shared tail on their first write. The same runs on a layout with a sliding-window layer group
(engine/kv/layout.py), whose blocks behind the window are let go: every block a group adopts holds KV of exactly
the prompt's prefix, written for that group."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.kv.block_pool import FREE, HELD, TAKEN, BlockPool
from engine.kv.layout import Layout
from engine.kv.paged import PagedKV
from engine.kv.prefix_cache import PrefixCache

BS, BLOCKS = 4, 12
FAMILIES = [[1, 2, 3, 1, 2, 3, 1, 2], [2, 2, 2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]]


class PagedKVMachine(RuleBasedStateMachine):
    layout = Layout.of([0, 0])
    blocks = BLOCKS
    chunk = 0

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(BS)
        self.pool = BlockPool(self.blocks, BS, index=self.cache)
        self.kv = PagedKV(self.pool, self.cache, self._copy, self.layout, self.chunk)
        self.running: list[Request] = []
        self.truth: dict[int, dict[int, int]] = {}      # block -> {offset: token} actually written there
        self.made: dict[int, dict[int, tuple]] = {}     # block -> {offset: (group, the ids up to there)}
        self.ids = 0

    def _copy(self, src: int, dst: int) -> None:
        self.truth[dst] = dict(self.truth.get(src, {}))
        self.made[dst] = dict(self.made.get(src, {}))

    def _write(self, req: Request, start: int, end: int) -> None:
        for g in range(self.layout.groups):
            slots = self.kv.slots(req, start, end) if g == 0 else self.kv.groups(req, start, end)[g - 1][0]
            for slot, pos in zip(slots, range(start, end)):
                if g == 0:
                    self.truth.setdefault(slot // BS, {})[slot % BS] = req.all_ids[pos]
                self.made.setdefault(slot // BS, {})[slot % BS] = (g, tuple(req.all_ids[:pos + 1]))

    @rule(family=st.integers(0, len(FAMILIES) - 1), cut=st.integers(1, 8), tail=st.lists(st.integers(1, 3),
          max_size=6), max_tokens=st.integers(1, 12))
    def admit(self, family, cut, tail, max_tokens):
        """Prompts from a few families: duplicates, full-prompt hits and partial hits all happen."""
        if len(self.running) >= 4:
            return
        req = Request(self.ids, FAMILIES[family][:cut] + tail, SamplingParams(max_tokens=max_tokens))
        self.ids += 1
        if not self.kv.fits(req) or not self.kv.admit(req):
            return
        adopted = req.num_computed
        for g in range(self.layout.groups):             # adopted blocks hold exactly this prompt's prefix's KV
            for pos in range(self.layout.first_needed(g, adopted), adopted):
                block = req.tables[g][pos // BS]
                assert self.made[block][pos % BS] == (g, tuple(req.all_ids[:pos + 1]))
        self.running.append(req)
        self._prefill_chunk(req)

    def _prefill_chunk(self, req: Request) -> None:
        """One prefill step: a sliding group's blocks come chunk by chunk, from what admission reserved."""
        end = min(req.prefill_target, req.num_computed + (self.chunk or req.prefill_target))
        assert self.kv.grow(req, end)
        self._write(req, req.num_computed, end)
        req.num_computed = req.num_allocated = end
        self.kv.commit(req)
        if not req.prefilling:
            req.output_ids.append(1 + req.id % 3)

    @property
    def ready(self) -> list[Request]:
        return [r for r in self.running if not r.prefilling]

    @precondition(lambda self: any(r.prefilling for r in self.running))
    @rule(i=st.integers(0, 3))
    def prefill(self, i):
        filling = [r for r in self.running if r.prefilling]
        self._prefill_chunk(filling[i % len(filling)])

    @precondition(lambda self: self.ready)
    @rule(i=st.integers(0, 3), token=st.integers(1, 3))
    def decode(self, i, token):
        req = self.ready[i % len(self.ready)]
        p = req.num_computed
        if len(req.output_ids) >= req.params.max_tokens or not self.kv.grow(req, p + 1):
            return
        self._write(req, p, p + 1)
        req.num_computed = req.num_allocated = p + 1
        self.kv.commit(req)
        req.output_ids.append(token)

    @precondition(lambda self: self.ready and len(self.running) < 6)
    @rule(i=st.integers(0, 3))
    def fork(self, i):
        """A sequence of a parallel-sampling request takes a copy of another's KV and output so far."""
        src = self.ready[i % len(self.ready)]
        seq = Request(self.ids, src.prompt_ids, src.params, output_ids=list(src.output_ids))
        self.ids += 1
        self.kv.fork(src, seq)
        seq.num_computed = seq.num_allocated = src.num_computed
        self.running.append(seq)

    @precondition(lambda self: self.ready)
    @rule(i=st.integers(0, 3))
    def speculate_and_unwind(self, i):
        """A lookahead step reserves a position, then the row finishes and gives it back."""
        req = self.ready[i % len(self.ready)]
        p = req.num_computed
        if self.kv.grow(req, p + 1):
            self.kv.slots(req, p, p + 1)
            self.kv.trim(req, p)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 3))
    def finish(self, i):
        req = self.running.pop(i % len(self.running))
        self.kv.release(req)

    @invariant()
    def bookkeeping(self):
        pool, n = self.pool, self.blocks
        named = Counter(b for r in self.running for t, lo in zip(r.tables, r.slid) for b in t[lo:])
        assert all(pool.ref[b] == named[b] for b in range(n))
        assert pool.num_free + pool.num_used + pool.num_cached == n
        assert pool.num_free == sum(1 for s in pool.map if s in (FREE, HELD))
        for b in range(n):
            if pool.map[b] != TAKEN:
                assert pool.ref[b] == 0 and b not in pool.cached and b not in self.cache
            if b in pool.cached:
                assert pool.ref[b] == 0 and b in self.cache
        for r in self.running:                           # a sliding group holds its window and one block more
            for g, w in enumerate(self.layout.windows):
                if w:
                    assert r.slid[g] >= self.layout.first_needed(g, r.num_computed) // BS - 1

    @invariant()
    def cache_maps_to_real_content(self):
        for h, blocks in self.cache.index.items():
            for b in blocks:
                entry = self.cache.content[b]
                assert entry.bucket == h and entry.key.block == b
                assert [self.truth[b][o] for o in range(BS)] == list(entry.tokens)


    @invariant()
    def attached_blocks_hold_their_groups_kv(self):
        for (g, key), b in self.cache.attached.items():
            entry = self.cache.content.get(key.block)
            if entry is not None and entry.key == key:          # the registration it hangs on still stands
                assert all(self.made[b][o][0] == g for o in range(BS))


class HybridKVMachine(PagedKVMachine):
    """One full layer and one with a window of 6 positions: two groups of one layer each; prefill in chunks of 5."""
    layout = Layout.of([0, 6])
    blocks = 2 * BLOCKS
    chunk = 5


PagedKVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
HybridKVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedKV = PagedKVMachine.TestCase
TestHybridKV = HybridKVMachine.TestCase
