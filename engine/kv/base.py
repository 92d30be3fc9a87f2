"""The storage protocol paged and dense KV implement: what the scheduler and the step loop ask of KV."""
from __future__ import annotations

from typing import Protocol

from engine.core.request import Request


class KVStorage(Protocol):
    def fits(self, req: Request) -> bool:
        """Whether the request could ever run, alone on empty storage."""

    def admit(self, req: Request) -> bool:
        """Adopt the longest cached prefix and make room for the rest of the prefill (sets num_computed and
        num_allocated to the adopted length); False, with nothing taken, when there is no room now."""

    def grow(self, req: Request, positions: int) -> bool:
        """Make room for `positions` positions, the next one to be written private; False, with nothing taken,
        when there is no room now."""

    def fork(self, src: Request, dst: Request) -> None:
        """Give `dst` the committed KV of `src` (parallel sampling): paged shares every block by reference and
        copies a shared block only when a sequence first writes into it; dense copies the buffer."""

    def slots(self, req: Request, start: int, end: int) -> list[int]:
        """Flat cache slots the runner writes positions [start, end) to (paged; dense addresses by buffer)."""

    def groups(self, req: Request, start: int, end: int) -> list[tuple[list[int], list[int]]]:
        """Paged, a model with sliding-window layers: (slots, block table) of each layer group past the first
        (engine/kv/layout.py); else none."""

    def trim(self, req: Request, positions: int) -> None:
        """Give back the room past `positions` (an unwound speculative position)."""

    def announce(self, req: Request, end: int) -> None:
        """KV events: a prefill to position `end` is about to run; announce the blocks it will fill."""

    def withdraw(self) -> None:
        """KV events: the step that announced failed; take back what it announced."""

    def commit(self, req: Request) -> None:
        """KV up to num_computed is final: offer it to the prompt cache."""

    def release(self, req: Request) -> None:
        """The request is done with its KV (finished or preempted)."""

    def stats(self) -> dict[str, int]:
        """Blocks (dense: buffers) by state: free, used, cached."""
