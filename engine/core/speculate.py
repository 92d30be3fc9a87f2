"""Speculative decoding's verify step: a sequence with k draft tokens rides in one decode step as k+1 rows of one
position each (its last token, then each draft), every row sampled as if the tokens before it had come one at a
time; the longest prefix of drafts equal to what was sampled is accepted, plus the token sampled after it.

A draft x carries no probability, so accepting it when the sample at its position equals it accepts x with
probability p(x) and otherwise keeps the sample, drawn from p without x renormalised: vLLM's rule for n-gram
drafts, and the output distribution of decoding without speculation (greedy: the same tokens).

A draft token pays when the chance it is taken is at least what its row adds to the step against what the step
yields without it (`worth`): a row adds ROW_COST of a one-row step while the step is within the runner's cheap
rows (the weights are read once for every row), LATE_COST past them (the products bound the step), and a step
yields about a token a row, so the bar rises with the step's width and a full batch does not pay for drafts.
Per sequence, a round whose acceptance falls below the bar makes it skip the next 1, 2, 4 ... 32 chances to draft,
and a round above it resets that."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from engine.core.ngram import Lookup, NgramConfig
from engine.core.request import Request
from engine.runners.base import Row

if TYPE_CHECKING:
    from engine.core.engine import Engine

MAX_SKIP = 32
ROW_COST = 0.15  # a decode row's cost in one-row steps, within the runner's step_rows (perf.bench_rows)
LATE_COST = 0.3  # past them: 0.15 on an Intel Xeon with AMX, 0.3 on an AMD EPYC (int8 blocks, 2 threads)
DECAY = 0.8      # per verify round, of the counts a sequence's acceptance rate is estimated from


def cost(width: int, cheap: int) -> float:
    """A step of `width` rows against a one-row step, on a runner whose steps take `cheap` rows at ROW_COST."""
    return 1 + ROW_COST * (min(width, cheap) - 1) + LATE_COST * max(width - cheap, 0)


def worth(width: int, cheap: int) -> float:
    """The chance of being taken at which the row that makes a step `width` rows pays: what it adds to the step
    against the step without it, which yields about a token a row."""
    return (width - 1) * (cost(width, cheap) / cost(width - 1, cheap) - 1)


@dataclass(slots=True)
class Pace:
    """One sequence's drafting: how often its drafts were taken (decayed counts: tokens accepted, and rounds that
    ended on a rejection), and the chances it skips while its drafts do not pay."""
    hits: float = 0.0
    misses: float = 0.0
    skip: int = 0
    backoff: int = 1

    @property
    def rate(self) -> float:
        """The chance a draft token is taken, given the one before it was (Laplace's estimate)."""
        return (self.hits + 1) / (self.hits + self.misses + 2)

    def length(self, k: int, width: int, cheap: int) -> int:
        """Draft tokens worth verifying in a step of `width` rows so far: the j-th pays while rate^j, the chance it
        is reached and taken, is at least the bar of the step it widens; at least one, as a probe."""
        j, rate = 1, self.rate
        while j < k and rate ** (j + 1) >= worth(width + j + 1, cheap):
            j += 1
        return j

    def record(self, drafted: int, accepted: int, bar: float) -> None:
        self.hits, self.misses = DECAY * self.hits + accepted, DECAY * self.misses + (accepted < drafted)
        if self.rate >= bar:
            self.backoff = 1
        else:                                    # not paying: skip the next 1, 2, 4 ... chances, then probe
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, MAX_SKIP)


class Speculator:
    def __init__(self, config: NgramConfig, rows: int, cheap: int) -> None:
        """`rows`: the most rows a step of the runner takes in one pass; `cheap`: how many it takes at little more
        than one row's cost."""
        self.config, self.rows, self.cheap = config, rows, cheap
        self.lookups: dict[int, Lookup] = {}
        self.paces: dict[int, Pace] = {}

    def step(self, eng: Engine) -> bool:
        """This tick's decode as a verify step, when any request drafts (False: none does; decode as usual). The
        step in flight is read first: drafts follow the latest token, and the step runs alone."""
        batch = [r for r in eng.scheduler.decoding() if eng._wants_step(r)]
        ready = self.ready(batch)
        if not self.pays(len(batch)):
            return False
        if not any(self._lookup(r).propose(r.prompt_ids, r.output_ids, 1) for r in ready):
            return False                     # (without the token in flight: a guess that spares a drain)
        for req, token, lp in eng.lookahead.drain():
            eng._commit(req, token, lp)
        batch = eng._reserve()
        room = {r.id: min(r.params.max_tokens - len(r.output_ids), eng.max_model_len - r.seq_len) - 1 for r in batch}
        going = {r.id for r in batch}
        drafts = self.drafts([r for r in ready if r.id in going], len(batch), room)
        drafts = {i: d for i, d in drafts.items() if eng.kv.grow(eng.requests[i], eng.requests[i].num_allocated +
                                                                 1 + len(d))}   # short of blocks: no drafts
        if not drafts:
            return False
        started, rows, spans = time.thread_time(), [], []
        for req in batch:
            draft = drafts.get(req.id, [])
            spans.append((req, draft, len(rows)))
            rows += self._rows(eng, req, draft)
            req.num_allocated += 1 + len(draft)
        handle = eng.runner.forward(rows, None)
        eng.runner.sample(handle)
        sampled = eng.runner.fetch(handle)
        eng.recorder.decode_tick(batch, time.thread_time() - started, 0)
        logprobs = sampled.logprobs or [None] * len(rows)
        bar = worth(len(rows), self.cheap)
        for req, draft, at in spans:
            got = sampled.tokens[at:at + len(draft) + 1]
            took = next((i for i, (t, d) in enumerate(zip(got, draft)) if t != d), len(draft))
            for token, lp in zip(got[:took + 1], logprobs[at:at + took + 1]):
                req.num_computed += 1
                eng._commit(req, token, lp)
                if req.finished:
                    break
            if draft:
                self.record(req, len(draft), took, bar)
                eng.recorder.speculated(req, len(draft), took)
            if not req.finished:
                req.uncounted += draft[:took] if req.params.penalized else []
                if req.num_allocated > req.num_computed:           # the rejected drafts' positions
                    eng.kv.trim(req, req.num_computed)
                    req.num_allocated = req.num_computed
        return True

    @staticmethod
    def _rows(eng: Engine, req: Request, draft: list[int]) -> list[Row]:
        """The request's last token's row, then one per draft, each sampled as if the drafts before it were
        output already (min_tokens, bad words, penalties, the grammar's mask)."""
        first, p = eng._decode_row(req, -1), req.num_allocated
        rows = [first]
        for j, token in enumerate(draft, 1):
            later = req.bad_words and req.bad_words.sequences and partial(req.bad_words.banned,
                                                                          req.output_ids + draft[:j])
            rows.append(replace(first, start=p + j, tokens=[token], slots=eng.kv.slots(req, p + j, p + j + 1),
                                groups=eng.kv.groups(req, p + j, p + j + 1), fed_output=False, counted=(),
                                ban=eng._ban(req, j), ban_later=later or None, drafts=tuple(draft[:j]),
                                grammar=req.grammar and req.grammar.ahead(draft[:j])))
        return rows

    def _lookup(self, req: Request) -> Lookup:
        lookup = self.lookups.get(req.id)
        if lookup is None:
            lookup = self.lookups[req.id] = Lookup(self.config)
        return lookup

    def ready(self, batch: list[Request]) -> list[Request]:
        """The requests that may draft this step (once per decode tick: the others' skips count down)."""
        out = []
        for req in batch:
            pace = self.paces.get(req.id)
            if pace is not None and pace.skip:
                pace.skip -= 1
            else:
                out.append(req)
        return out

    def drafts(self, ready: list[Request], width: int, room: dict[int, int]) -> dict[int, list[int]]:
        """Draft tokens per request id, for the ready requests that find any; `width`: the batch's rows without
        drafts; `room`: how many tokens each request may still produce past the next one (max_tokens, context)."""
        out: dict[int, list[int]] = {}
        for req in ready:
            pace = self.paces.get(req.id)
            if not self.pays(width):
                break
            k = min(pace.length(self.config.k, width, self.cheap) if pace else 1, self.rows - width,
                    room.get(req.id, 0))
            if k <= 0:
                continue
            draft = self._lookup(req).propose(req.prompt_ids, req.output_ids, k)
            if draft and req.grammar is not None:          # only what the grammar takes: the rest would be refused
                draft = draft[:req.grammar.legal(draft)]
            if draft:
                out[req.id] = draft
                width += len(draft)
        return out

    def pays(self, width: int) -> bool:
        """Whether a row past a step of `width` rows fits in the pass and could pay, were its draft surely taken."""
        return width < self.rows and worth(width + 1, self.cheap) < 1

    def record(self, req: Request, drafted: int, accepted: int, bar: float) -> None:
        self.paces.setdefault(req.id, Pace()).record(drafted, accepted, bar)

    def release(self, req: Request) -> None:
        self.lookups.pop(req.id, None)
        self.paces.pop(req.id, None)
