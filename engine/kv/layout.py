"""How layers share the paged KV pool: layer groups with a block table each, all of one page size.

A model whose layers all attend to everything is one group: a block holds every layer's K/V of its positions. A
model with sliding-window layers (Gemma 3: five in six; Mistral: all) splits its layers into groups of equal size,
each group all full or all sliding (one window), as vLLM's hybrid KV cache manager does. A block then holds one
group's layers' K/V of its positions, so every group draws from the same pool, and a sliding group's table lets go of
the blocks behind its window while a full group keeps all of its. The cache stores `width` layers' pages per block:
layer l reads and writes page `slot[l]` of the blocks in its group's table.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class Layout:
    windows: tuple[int, ...]      # per group: positions a query sees (0: all); a full group, when any, first
    group: tuple[int, ...]        # per layer: its group
    slot: tuple[int, ...]         # per layer: its page within a block
    width: int                    # layers per group: pages per block

    @classmethod
    def of(cls, windows: list[int], hybrid: bool = True) -> Layout:
        """The groups of layers whose windows are `windows` (0: full). With `hybrid` off, or no window at all, one
        group of every layer whose table keeps every block (its window: 0)."""
        n = len(windows)
        kinds = sorted(set(windows))          # 0 (full) sorts first: the group the prompt cache is keyed by
        if not hybrid or kinds == [0]:
            return cls((0,), (0,) * n, tuple(range(n)), n)
        members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        width = 0
        for layers in members.values():
            width = gcd(width, len(layers))
        group, slot, out = [0] * n, [0] * n, []
        for w in kinds:
            for k in range(0, len(members[w]), width):
                for j, layer in enumerate(members[w][k:k + width]):
                    group[layer], slot[layer] = len(out), j
                out.append(w)
        return cls(tuple(out), tuple(group), tuple(slot), width)

    @property
    def groups(self) -> int:
        return len(self.windows)

    def first_needed(self, g: int, position: int) -> int:
        """The lowest position a query at `position` or later reads in group g."""
        w = self.windows[g]
        return max(0, position - w + 1) if w else 0

    def span(self, g: int, positions: int, block_size: int, chunk: int = 0) -> int:
        """The most blocks group g holds for a sequence of `positions` positions prefilled `chunk` at a time (0: all
        at once): a sliding group, its window, a chunk, and the blocks they straddle."""
        w, full = self.windows[g], cdiv(positions, block_size)
        return full if not w or not chunk else min(full, cdiv(w, block_size) + cdiv(chunk, block_size) + 3)

    def blocks(self, positions: int, block_size: int, chunk: int = 0) -> int:
        """The most blocks one sequence holds, every group together."""
        return sum(self.span(g, positions, block_size, chunk) for g in range(self.groups))
