"""Per-request state: prompt and output ids, status, timings, committed vs allocated KV length."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial

from engine.core.bad_words import BadWords
from engine.core.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None      # stop | length | abort | error
    error: str | None = None
    cancelled: bool = False
    # KV: positions [0, num_computed) hold committed KV; [num_computed, num_allocated) are in flight
    num_computed: int = 0
    num_allocated: int = 0
    num_cached: int = -1                  # tokens adopted from the prompt cache at first admission
    tables: list[list[int]] = field(default_factory=list)     # paged: a block table per layer group
    slid: list[int] = field(default_factory=list)       # per group: leading entries let go (behind its window)
    block_keys: list = field(default_factory=list)    # the prefix cache's registrations of its full blocks
    buf: int = -1                         # dense buffer id
    # text
    text: str = ""
    sent_text: int = 0                    # chars of `text` already streamed
    sent_ids: int = 0                     # output ids already streamed
    detok: object | None = None
    logprobs: list | None = None          # per output position {token id: Logprob}, when params.logprobs is set
    grammar: object | None = None         # structured output: the Matcher its committed tokens advance
    bad_words: BadWords | None = None
    prompt_logprobs: list | None = None   # per prompt position (None first), when params.prompt_logprobs is set
    cumulative_logprob: float = 0.0       # the sum of the sampled tokens' logprobs
    # speculative decoding: accepted drafts its penalties have not counted yet; drafted and accepted tokens
    uncounted: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    # timings (monotonic seconds)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    decode_cpu: float = 0.0               # engine-thread CPU seconds of the decode ticks it rode in, its share
    # parallel sampling (n > 1): every sequence of the request, in index order (the first is the one that
    # prefills); `forks`: the sequences still waiting for that prefill to finish, on the first one only
    index: int = 0
    group: list[Request] | None = None
    forks: list[Request] = field(default_factory=list)

    @property
    def group_id(self) -> int:
        """The id the client knows: the first sequence's."""
        return self.id if self.group is None else self.group[0].id

    @property
    def width(self) -> int:
        """Batch rows it takes once its pending forks join it."""
        return 1 + len(self.forks)

    @property
    def block_table(self) -> list[int]:
        """The first layer group's blocks (the only group, unless the model has sliding-window layers)."""
        return self.tables[0] if self.tables else []

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Positions whose KV must exist before decoding: all but the last token once output exists, or in a
        parallel-sampling group (each sequence then samples its first token from its own decode step)."""
        return self.seq_len - 1 if self.output_ids or self.group else len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_flight(self) -> int:
        return self.num_allocated - self.num_computed

    @property
    def penalty_prompt(self) -> list[int] | None:
        """The prompt, when its repetition penalty needs it."""
        return self.prompt_ids if self.params.repetition_penalty != 1 else None

    @property
    def late_bans(self) -> bool:
        """Bad words of more than one token: a row's bans depend on the output before it."""
        return self.bad_words is not None and bool(self.bad_words.sequences)

    def ban_later(self, drafts: list[int] | None = None) -> Callable[[], list[int]] | None:
        """The longer bad words' bans, worked out when a row samples: from the output committed by then (and a
        verify row's drafts before it)."""
        if not self.late_bans:
            return None
        return partial(self.bad_words.banned, self.output_ids + drafts if drafts else self.output_ids)

    def take_uncounted(self) -> tuple[int, ...]:
        """Accepted drafts the penalties have not counted: they join the counts with the next row built."""
        out, self.uncounted = tuple(self.uncounted), []
        return out

    def decode_timing(self) -> tuple[float, float] | None:
        """The engine's view of its decode: (tokens per second from its first sampled token to its last, engine-thread
        CPU ms per token after the first); None before a second token."""
        n = len(self.output_ids)
        if n < 2 or self.last_token_at <= self.first_token_at:
            return None
        return (n - 1) / (self.last_token_at - self.first_token_at), 1000 * self.decode_cpu / (n - 1)
