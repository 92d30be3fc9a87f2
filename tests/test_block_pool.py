"""Block pool and prompt-cache bookkeeping, plain Python."""
from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool
from engine.kv.dense import DenseStore
from engine.kv.prefix_cache import PrefixCache, root


def test_allocate_release_and_lru_eviction():
    cache = PrefixCache(2)
    pool = BlockPool(4, block_size=2, index=cache)
    a, b, c, d = (pool.allocate() for _ in range(4))
    assert not pool.can_allocate(1)
    first = cache.register(a, root(None), [1, 2])
    cache.register(b, first, [3, 4])
    for blk in (b, a, c, d):
        pool.release(blk)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (2, 2, 0)
    assert [k.block for k in cache.match([1, 2, 3, 4, 5])] == [a, b]
    pool.allocate(), pool.allocate()              # the free list first
    assert pool.num_cached == 2
    pool.allocate()                               # then the least recently freed cached block: b
    assert [k.block for k in cache.match([1, 2, 3, 4])] == [a]
    pool.adopt(a)
    assert pool.ref[a] == 1 and pool.num_cached == 0
    with pytest.raises(MemoryError):
        pool.allocate()


def test_shared_block_is_not_writable():
    pool = BlockPool(2, block_size=4)
    blk = pool.allocate()
    pool.check_writable(blk)
    pool.adopt(blk)
    with pytest.raises(RuntimeError, match="ref count 2"):
        pool.check_writable(blk)
    pool.release(blk), pool.release(blk)
    with pytest.raises(RuntimeError, match="released with ref count 0"):
        pool.release(blk)


def test_duplicate_content_registers_once():
    cache = PrefixCache(2)
    pool = BlockPool(3, block_size=2, index=cache)
    a, b = pool.allocate(), pool.allocate()
    key = cache.register(a, root(None), [7, 8])
    assert cache.register(b, root(None), [7, 8]) == key and list(cache.index.values()) == [[a]]
    pool.release(b)
    assert pool.num_free == 2          # b holds no cached content: straight back to the free list


def test_dense_store_longest_prefix_and_byte_bound():
    freed = []
    store = DenseStore(max_bytes=100, free=freed.append)
    store.donate(1, [1, 2, 3], 40)
    store.donate(2, [1, 2, 9, 9], 40)
    assert store.take([1, 2, 9, 5]) == (2, 3)
    assert store.take([4]) is None
    store.donate(3, [5], 40)
    store.donate(4, [6], 40)                 # 120 > 100: buffer 1, least recently donated, is freed
    assert freed == [1] and store.bytes == 80
    store.donate(5, [7], 500)                # larger than the whole store: freed at once
    assert freed == [1, 5]


def test_new_tables_start_at_the_lowest_run_with_headroom_held():
    pool = BlockPool(16, block_size=4)
    a = pool.allocate_run(3, headroom=2)
    assert a == [0, 1, 2] and pool.num_free == 13      # 3, 4 are held for a, still counted free
    b = pool.allocate_run(2, headroom=1)
    assert b == [5, 6]                                  # skips a's headroom
    assert pool.allocate_run(2, after=a[-1]) == [3, 4]  # a grows into its headroom
    assert pool.allocate(after=4) == 8                  # 5 is b's: the lowest free block (7 is b's headroom)
    assert pool.allocate(after=b[-1]) == 7
    for blk in [0, 1, 2, 3, 4]:
        pool.release(blk)
    assert pool.allocate_run(5) == [0, 1, 2, 3, 4]      # the lowest run again
    assert pool.allocate_run(3, headroom=100) == [9, 10, 11]        # no run that long: no headroom


def test_headroom_is_released_with_its_table_and_used_when_nothing_else_is_free():
    pool = BlockPool(6, block_size=4)
    a = pool.allocate_run(2, headroom=3)                # 2, 3, 4 held
    b = [pool.allocate(), pool.allocate()]              # only 5 is plain free, then a held block
    assert b == [5, 2]
    pool.unhold(a[-1])                                  # a is gone: 3, 4 are plain free again
    assert pool.allocate_run(2) == [3, 4]
    assert not pool.can_allocate(1)


def test_eviction_prefers_the_block_after_the_table():
    evicted = []

    class Everything:                                   # every released block keeps cached content
        def __contains__(self, block: int) -> bool:
            return True

        def forget(self, block: int) -> None:
            evicted.append(block)
    pool = BlockPool(4, block_size=2, index=Everything())
    blocks = pool.allocate_run(4)
    for blk in blocks:                                  # LRU order 0, 1, 2, 3
        pool.release(blk)
    first = pool.allocate()                             # nothing free: the least recently used
    assert first == 0 and pool.allocate(after=first) == 1 and evicted == [0, 1]
    assert pool.allocate(after=3) == 2                  # 4 does not exist: LRU again


def test_old_policy_hands_out_blocks_in_release_order():
    pool = BlockPool(4, block_size=2, contiguous=False)
    a = pool.allocate_run(4)
    for blk in reversed(a):
        pool.release(blk)
    assert pool.allocate_run(4) == [3, 2, 1, 0]
