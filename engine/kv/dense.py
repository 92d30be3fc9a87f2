"""Dense KV: one buffer per sequence, grown in steps of 256 tokens; finished buffers are donated to the store."""
from __future__ import annotations

from typing import Protocol

from engine.prompt_cache import DenseStore
from engine.request import Request

STEP = 256


class DenseBuffers(Protocol):
    """What a runner provides for dense storage."""
    def dense_alloc(self, capacity: int) -> int: ...
    def dense_resize(self, buf: int, capacity: int) -> None: ...
    def dense_free(self, buf: int) -> None: ...


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
        taken = self.store.take(req.all_ids) if self.store else None
        if taken is None:
            req.buf, adopted = self._alloc(round_up(req.prefill_target + 1)), 0
        else:
            req.buf, matched = taken
            adopted = min(matched, req.seq_len - 1)
            self.grow(req, req.prefill_target + 1)
        req.num_computed = req.num_allocated = adopted
        return True

    def grow(self, req: Request, positions: int) -> bool:
        if positions > self.capacity[req.buf]:
            self.capacity[req.buf] = round_up(positions)
            self.buffers.dense_resize(req.buf, self.capacity[req.buf])
        return True

    def slots(self, req: Request, start: int, end: int) -> list[int]:
        return []

    def trim(self, req: Request, positions: int) -> None:
        pass    # positions past num_computed are simply overwritten later

    def commit(self, req: Request) -> None:
        pass

    def release(self, req: Request) -> None:
        buf, req.buf = req.buf, -1
        if self.store is None:
            self._free(buf)
        else:
            nbytes = self.capacity[buf] * self.bytes_per_token
            self.store.donate(buf, req.all_ids[:req.num_computed], nbytes)

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
