"""KV events: the blocks the prompt cache gained and lost, for routers that route by where a prefix is cached
(vLLM's KV events, which the vLLM project's router reads for its kv_aware policy, and NVIDIA Dynamo's KV router).

A block is named by a hash of its chain: its tokens and the hash of the block before it (for a chain's first
block, the request's cache salt), so the same prefix has the same hashes on every replica. Events wait here until
the engine hands a step's worth to the publisher (engine/serving/kv_publisher.py)."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Stored:
    hashes: list[int]
    parent: int | None                # the hash of the block before the first one; None: a chain's first
    tokens: list[int]                 # every block's tokens, in order


@dataclass(slots=True)
class Removed:
    hashes: list[int]


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def chain_hash(parent: int | None, salt: str | None, tokens: Sequence[int]) -> int:
    """63 bits of sha256(parent hash or salt, tokens): non-negative, as routers read an int64 block hash."""
    h = hashlib.sha256(struct.pack(">Q", parent) if parent is not None else b"root:" + (salt or "").encode())
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest()[:8], "big") >> 1


@dataclass(slots=True)
class BlockEvents:
    pending: list[Event] = field(default_factory=list)

    def stored(self, digest: int, parent: int | None, tokens: Sequence[int]) -> None:
        """A block registered; a block that continues the last stored chain joins its event, as vLLM batches a
        request's new blocks."""
        last = self.pending[-1] if self.pending else None
        if isinstance(last, Stored) and parent is not None and last.hashes[-1] == parent:
            last.hashes.append(digest)
            last.tokens.extend(tokens)
        else:
            self.pending.append(Stored([digest], parent, list(tokens)))

    def removed(self, digest: int) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, Removed):
            last.hashes.append(digest)
        else:
            self.pending.append(Removed([digest]))

    def cleared(self) -> None:
        self.pending = [Cleared()]

    def drain(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out
