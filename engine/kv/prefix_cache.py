"""The prompt cache of paged KV: an index of full blocks, exact on tokens and on the whole chain before them.

Each registered block records its tokens and its parent: the registration of the block before it, as a Key (the
block id with the registration's number, so a parent that was evicted and reused for other tokens is never taken
for the old one), or, for a chain's first block, the request's cache salt. A block is found only if its tokens and
its parent are equal to what the prompt has there, so by induction its whole prefix is: the hash only picks a
bucket to look in, and a collision costs a longer look, never another prompt's KV. Requests with different salts
share nothing.

A model with sliding-window layers keeps its other layer groups' blocks (engine/kv/layout.py) under the
registrations of the first group's: `attach` files group g's block of the same positions under that Key. Keys are
never reused, so a block attached to a registration that was evicted since is never found again.

The block pool asks the index whether a freed block holds cached content (then it stays reusable) and tells it
when it evicts one.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from engine.kv.events import BlockEvents, chain_hash


class Key(NamedTuple):
    """One registration: the block that holds it and its number (unique over the index's life)."""
    block: int
    serial: int


Parent = Key | tuple[str, str | None]        # the block before, or ("root", cache salt) for a chain's first block


def root(salt: str | None) -> Parent:
    return ("root", salt)


def bucket(parent: Parent, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class Entry(NamedTuple):
    key: Key
    parent: Parent
    tokens: tuple[int, ...]
    bucket: int
    digest: int | None            # its chain hash, when KV events are published


class PrefixCache:
    def __init__(self, block_size: int, events: BlockEvents | None = None) -> None:
        self.block_size = block_size
        self.events = events                        # registrations and evictions, for KV events
        # live registrations per chain hash: an orphan (its parent evicted, then the chain prefilled again) and
        # its successor share one, and a router must hear of it once and lose it only with the last
        self.holders: dict[int, int] = {}
        self.promised: dict[int, int] = {}          # announced at scheduling, registered after the step computes
        self.index: dict[int, list[int]] = {}       # bucket -> blocks registered under it
        self.content: dict[int, Entry] = {}         # block -> what it holds
        self.serials = itertools.count()
        self.attached: dict[tuple[int, Key], int] = {}       # (group, the first group's Key) -> block
        self.attachment: dict[int, tuple[int, Key]] = {}

    def __contains__(self, block: int) -> bool:
        return block in self.content or block in self.attachment

    def attach(self, group: int, key: Key, block: int) -> None:
        """File group `group`'s block for the positions of registration `key` (unless one is filed already)."""
        if (group, key) not in self.attached and block not in self.attachment:
            self.attached[group, key] = block
            self.attachment[block] = (group, key)

    def find(self, group: int, key: Key) -> int | None:
        return self.attached.get((group, key))

    def match(self, tokens: Sequence[int], salt: str | None = None) -> list[Key]:
        """The registrations of the longest cached chain of full blocks that prefixes `tokens`."""
        bs, parent, keys = self.block_size, root(salt), []
        for start in range(0, len(tokens) - bs + 1, bs):
            found = self._find(parent, tuple(tokens[start:start + bs]))
            if found is None:
                break
            keys.append(found)
            parent = found
        return keys

    def promise(self, parent: int | None, salt: str | None, tokens: Sequence[int]) -> int:
        """KV events: a block a prefill about to run will fill, announced now (as vLLM announces a block when it
        schedules it), so a router sees it before the step computes it; its registration keeps the promise.
        `parent`: the chain hash before it (None: a chain's first block). Returns its chain hash."""
        digest = chain_hash(parent, salt, tokens)
        if not self.holders.get(digest) and not self.promised.get(digest):
            self.events.stored(digest, parent, tokens)
        self.promised[digest] = self.promised.get(digest, 0) + 1
        return digest

    def withdraw(self) -> None:
        """A step failed before registering what it promised: what no registration holds is gone."""
        for digest in self.promised:
            if not self.holders.get(digest):
                self.events.removed(digest)
        self.promised.clear()

    def register(self, block: int, parent: Parent, tokens: Sequence[int]) -> Key:
        """Offer a full block; returns the registration that now stands for these tokens after `parent` (an
        earlier one, when another block already holds them: then `block` stays unregistered)."""
        tokens = tuple(tokens)
        digest = up = None
        if self.events is not None:
            above = self.content.get(parent.block) if isinstance(parent, Key) else None
            up = above.digest if above is not None and above.key == parent else None
            digest = chain_hash(up, None if isinstance(parent, Key) else parent[1], tokens)
        announced = digest is not None and self._keep(digest)
        found = self._find(parent, tokens)
        if found is not None:
            return found
        if block in self.content:          # a block holds one registration; a fork's shared block is offered again
            return self.content[block].key
        h = bucket(parent, tokens)
        key = Key(block, next(self.serials))
        if digest is not None:
            self.holders[digest] = self.holders.get(digest, 0) + 1
            if self.holders[digest] == 1 and not announced:
                self.events.stored(digest, up, tokens)
        self.content[block] = Entry(key, parent, tokens, h, digest)
        self.index.setdefault(h, []).append(block)
        return key

    def forget(self, block: int) -> None:
        if block in self.attachment:
            del self.attached[self.attachment.pop(block)]
            return
        entry = self.content.pop(block)
        if self.events is not None and entry.digest is not None:
            self.holders[entry.digest] -= 1
            if not self.holders[entry.digest]:
                del self.holders[entry.digest]
                self.events.removed(entry.digest)
        blocks = self.index[entry.bucket]
        blocks.remove(block)
        if not blocks:
            del self.index[entry.bucket]

    def _keep(self, digest: int) -> bool:
        """Take one promise of `digest` (whether it was announced already)."""
        n = self.promised.get(digest, 0)
        if n > 1:
            self.promised[digest] = n - 1
        elif n:
            del self.promised[digest]
        return n > 0 or bool(self.holders.get(digest))

    def _find(self, parent: Parent, tokens: tuple[int, ...]) -> Key | None:
        for block in self.index.get(bucket(parent, tokens), ()):
            entry = self.content[block]
            if entry.parent == parent and entry.tokens == tokens:
                return entry.key
        return None
