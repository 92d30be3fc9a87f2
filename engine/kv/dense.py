"""Dense KV: one buffer per sequence, grown in steps of 256 tokens; finished buffers are donated to the store."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from engine.core.request import Request

STEP = 256


class DenseBuffers(Protocol):
    """What a runner provides for dense storage."""
    def dense_alloc(self, capacity: int) -> int: ...
    def dense_resize(self, buf: int, capacity: int) -> None: ...
    def dense_free(self, buf: int) -> None: ...
    def dense_copy(self, src: int, dst: int, positions: int) -> None: ...


def round_up(n: int) -> int:
    return max(STEP, -(-n // STEP) * STEP)


class DenseKV:
    def __init__(self, buffers: DenseBuffers, bytes_per_token: int, store_bytes: int | None) -> None:
        self.buffers = buffers
        self.bytes_per_token = bytes_per_token
        self.capacity: dict[int, int] = {}
        self.store = DenseStore(store_bytes, self._free) if store_bytes is not None else None

    def fits(self, req: Request) -> bool:
        return True

    def admit(self, req: Request) -> bool:
        taken = self.store.take(req.all_ids, req.params.cache_salt) if self.store and \
            req.params.prompt_logprobs is None else None
        if taken is None:
            req.buf, adopted = self._alloc(round_up(req.prefill_target + 1)), 0
        else:
            req.buf, matched = taken
            adopted = min(matched, req.seq_len - 1)
            self.grow(req, req.prefill_target + 1)
        req.num_computed = req.num_allocated = adopted
        return True

    def fork(self, src: Request, dst: Request) -> None:
        dst.buf = self._alloc(self.capacity[src.buf])
        self.buffers.dense_copy(src.buf, dst.buf, src.num_computed)

    def grow(self, req: Request, positions: int) -> bool:
        if positions > self.capacity[req.buf]:
            self.capacity[req.buf] = round_up(positions)
            self.buffers.dense_resize(req.buf, self.capacity[req.buf])
        return True

    def slots(self, req: Request, start: int, end: int) -> list[int]:
        return []                       # the runner writes into the request's buffer by position

    def groups(self, req: Request, start: int, end: int) -> list[tuple[list[int], list[int]]]:
        return []

    def trim(self, req: Request, positions: int) -> None:
        pass                            # positions past num_computed are overwritten later

    def announce(self, req: Request, end: int) -> None:
        pass                                # KV events are paged only

    def withdraw(self) -> None:
        pass

    def commit(self, req: Request) -> None:
        pass                            # a buffer joins the store when it is released

    def release(self, req: Request) -> None:
        buf, req.buf = req.buf, -1
        if self.store is None:
            self._free(buf)
        else:
            nbytes = self.capacity[buf] * self.bytes_per_token
            self.store.donate(buf, req.all_ids[:req.num_computed], nbytes, req.params.cache_salt)

    def stats(self) -> dict[str, int]:
        stored = len(self.store.entries) if self.store else 0
        return {"free": 0, "used": len(self.capacity) - stored, "cached": stored}

    def _alloc(self, capacity: int) -> int:
        buf = self.buffers.dense_alloc(capacity)
        self.capacity[buf] = capacity
        return buf

    def _free(self, buf: int) -> None:
        del self.capacity[buf]
        self.buffers.dense_free(buf)


class DenseStore:
    """The prompt cache of dense KV: finished sequences' buffers (tokens + KV), least recently donated evicted
    first, within a byte bound. A buffer is taken only by a request of the same cache salt."""

    def __init__(self, max_bytes: int, free: Callable[[int], None]) -> None:
        self.max_bytes = max_bytes
        self.free = free
        self.entries: OrderedDict[int, tuple[tuple[int, ...], int, str | None]] = OrderedDict()  # buf -> (tokens,
        #                                                                                     bytes, salt)
        self.bytes = 0

    def donate(self, buf: int, tokens: Sequence[int], nbytes: int, salt: str | None = None) -> None:
        if nbytes > self.max_bytes or not tokens:
            self.free(buf)
            return
        while self.bytes + nbytes > self.max_bytes:
            self.evict()
        self.entries[buf] = (tuple(tokens), nbytes, salt)
        self.bytes += nbytes

    def take(self, tokens: Sequence[int], salt: str | None = None) -> tuple[int, int] | None:
        """Remove and return (buf, matched) for the entry of this salt sharing the longest prefix with `tokens`."""
        best, best_len = None, 0
        for buf, (stored, _, stored_salt) in self.entries.items():
            if stored_salt != salt:
                continue
            n = common_prefix(stored, tokens)
            if n > best_len:
                best, best_len = buf, n
        if best is None:
            return None
        _, nbytes, _ = self.entries.pop(best)
        self.bytes -= nbytes
        return best, best_len

    def evict(self) -> None:
        buf, (_, nbytes, _) = self.entries.popitem(last=False)
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
