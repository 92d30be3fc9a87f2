"""Speculative decoding's verify step: a sequence with k draft tokens rides in one decode step as k+1 rows of one
position each (its last token, then each draft), every row sampled as if the tokens before it had come one at a
time; the longest prefix of drafts equal to what was sampled is accepted, plus the token sampled after it.

A draft x carries no probability, so accepting it when the sample at its position equals it accepts x with
probability p(x) and otherwise keeps the sample, drawn from p without x renormalised: vLLM's rule for n-gram
drafts, and the output distribution of decoding without speculation (greedy: the same tokens).

A draft token pays when the chance it is taken is at least what its row adds to the step against what the step
yields without it (`Costs.worth`): a row adds `row` of a one-row step while the step is within the runner's cheap
rows (the weights are read once for every row), `late` past them (the products bound the step), both timed on the
model at load where the runner can, and a step yields about a token a row, so the bar rises with the step's width
and a full batch does not pay for drafts.
Per sequence, a round whose acceptance falls below the bar makes it skip the next 1, 2, 4 ... 32 chances to draft,
and a round above it resets that. Past the cheap rows it does not probe (a row there costs more than a probe could
find): it proposes without verifying, and the token decoding then samples tells whether the proposal would have been
taken (a shadow draft: under sampling too, the sample equals a draft x with probability p(x), the chance the rule
takes x), so its record grows without costing a row.

Where a runner's steps overlap the host (`chain`), a verify step launches from the step in flight (its first row fed
that step's token on the device, its drafts following a guess of that token) and stays in flight; the step after it
chains from each sequence's last draft row (engine/core/lookahead.py: spans)."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.core.lookahead import Span
from engine.core.ngram import NO_BLANKS, Blanks, Lookup, NgramConfig
from engine.core.request import Request
from engine.runners.base import Row

if TYPE_CHECKING:
    from engine.core.engine import Engine

MAX_SKIP = 32
DECAY = 0.8      # per verify round, of the counts a sequence's acceptance rate is estimated from


@dataclass(slots=True, frozen=True)
class Costs:
    """What a decode row adds to a step, in one-row steps: `row` within the runner's `cheap` rows, `late` past them,
    and `sampled` more for a row drawn at a temperature (its softmax and draw over the vocabulary). The defaults
    are an AMD EPYC's (int8 blocks, 2 threads; perf.bench_rows), for runners that do not time their rows
    (TorchRunner.row_costs: an Intel Xeon with AMX measured 0.22-0.24, 0.19-0.22 and 0.09-0.10 on Gemma 3 270M,
    once its GEMVs prefetched ahead and a one-row step got faster)."""
    cheap: int
    row: float = 0.15
    late: float = 0.25
    sampled: float = 0.0

    def cost(self, width: int) -> float:
        """A step of `width` rows against a one-row step."""
        return 1 + self.row * (min(width, self.cheap) - 1) + self.late * max(width - self.cheap, 0)

    def worth(self, width: int, sampled: bool = False) -> float:
        """The chance of being taken at which the row that makes a step `width` rows pays (`sampled`: a row drawn at
        a temperature): what it adds to the step against the step without it, which yields about a token a row."""
        added = self.cost(width) - self.cost(width - 1) + (self.sampled if sampled else 0.0)
        return (width - 1) * added / self.cost(width - 1)


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

    def length(self, k: int, width: int, costs: Costs, guessing: bool = False, sampled: bool = False) -> int:
        """Draft tokens worth verifying in a step of `width` rows so far: the j-th pays while rate^j, the chance it
        is reached and taken, is at least the bar of the step it widens (rate^(j+1) when the drafts follow a guess,
        taken as a draft would be); at least one, as a probe."""
        j, rate, g = 1, self.rate, int(guessing)
        while j < k and rate ** (j + 1 + g) >= costs.worth(width + j + 1, sampled):
            j += 1
        return j

    def count(self, drafted: int, accepted: int) -> None:
        """A round of `drafted` tokens, the first `accepted` of them taken (a shadow draft: a round of one token,
        without the backoff of a verified one)."""
        self.hits, self.misses = DECAY * self.hits + accepted, DECAY * self.misses + (accepted < drafted)

    def record(self, drafted: int, accepted: int, bar: float) -> None:
        self.count(drafted, accepted)
        if self.rate >= bar:
            self.backoff = 1
        else:                                    # not paying: skip the next 1, 2, 4 ... chances, then probe
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, MAX_SKIP)


class Speculator:
    def __init__(self, config: NgramConfig, rows: int, costs: Costs, chain: bool = False,
                 blanks: Blanks = NO_BLANKS) -> None:
        """`rows`: the most rows a step of the runner takes in one pass; `costs`: what its rows cost; `chain`:
        launch verify steps from the step in flight (a runner whose steps run while the host works, with lookahead
        on); `blanks`: the vocabulary's indentation tokens, for the proposer."""
        self.config, self.rows, self.costs, self.chain, self.blanks = config, rows, costs, chain, blanks
        self.lookups: dict[int, Lookup] = {}
        self.paces: dict[int, Pace] = {}
        self.shadows: dict[int, tuple[int, int]] = {}      # request id: (position, the token proposed there)

    def step(self, eng: Engine) -> bool:
        """This tick's decode as a verify step, when any request drafts (False: none does; decode as usual).

        Chained (see the module's docstring): the step launches from the step in flight, its drafts following a
        guess of the token in flight, and stays in flight itself. Otherwise the step in flight is read first, so
        drafts follow the latest token, and the verify step is read at once: under a grammar or multi-token bad
        words (a draft row's mask needs the tokens before it on the host), and on a runner whose steps do not
        overlap the host (a CPU: a wrong guess would cost rows and save nothing). A request with penalties keeps
        its counts on the device, which a void row would corrupt: its verify steps are read at once."""
        self.settle(eng)
        batch = [r for r in eng.scheduler.decoding() if eng._wants_step(r)]
        ready = self.ready(batch)
        if not self.pays(len(batch)):
            return False
        plain = not any(r.grammar is not None or r.late_bans for r in batch)    # no mask needs the host's tokens
        chain = self.chain and plain and eng.lookahead.inflight is not None
        keep = self.chain and plain and not any(r.params.penalized for r in batch)     # stays in flight
        ahead = self._ahead(eng) if chain else {}
        if not any(self._propose(r, 1, ahead.get(r.id))[1] for r in ready):
            return False
        if not chain:
            eng._take(eng.lookahead.drain())
        batch = eng._reserve()
        self.compare(batch)                                 # (after the step in flight was read, unless chained)
        ahead = self._ahead(eng) if chain else {}           # (short of blocks, the step in flight was read)
        room = {r.id: min(r.params.max_tokens - len(r.output_ids), eng.max_model_len - r.seq_len) - r.in_flight - 1
                for r in batch}
        going = {r.id for r in batch}
        drafts = self.drafts([r for r in ready if r.id in going], len(batch), room, ahead)
        drafts = {i: d for i, d in drafts.items() if eng.kv.grow(eng.requests[i], eng.requests[i].num_allocated +
                                                                 1 + len(d[1]))}   # short of blocks: no drafts
        if not drafts:
            return False
        started, before, rows, spans = time.thread_time(), eng.lookahead.pipelined, [], []
        where = eng.lookahead.sources()
        for req in batch:
            guess, draft = drafts.get(req.id, (-1, []))
            spans.append(Span(req, len(rows), req.num_allocated, draft, guess))
            rows += self._rows(eng, req, draft, where.get(req.id, -1))
        for span in spans:
            span.bar = self.costs.worth(len(rows), not span.req.params.greedy)
        results = eng.lookahead.launch(rows, spans)
        eng.recorder.decode_tick(batch, time.thread_time() - started, eng.lookahead.pipelined - before)
        eng._take(results)
        if not keep:
            eng._take(eng.lookahead.drain())
        return True

    def accept(self, eng: Engine, span: Span, got: list[int], logprobs: list) -> None:
        """Commit a verify span's samples: each draft while it equals the sample before it, then one more sample.
        (Whatever a draft followed, a guess right or wrong, its row saw the tokens before it: a draft equal to the
        sample is the token decoding would have come to.)"""
        req, draft = span.req, span.draft
        took = next((i for i, (t, d) in enumerate(zip(got, draft)) if t != d), len(draft))
        for token, lp in zip(got[:took + 1], logprobs[:took + 1]):
            req.num_computed += 1
            eng._commit(req, token, lp)
            if req.finished:
                break
        self.record(req, len(draft), took, span.bar)
        eng.recorder.speculated(req, len(draft), took)
        if not req.finished:
            req.uncounted += draft[:took] if req.params.penalized else []
            if took < len(draft):          # the rejected drafts' positions, and any step's launched after them
                eng.kv.trim(req, req.num_computed)
                req.num_allocated = req.num_computed

    def settle(self, eng: Engine) -> None:
        """Drafts in flight that followed a wrong guess (the token their first row is fed, read back since) are
        unlikely to be taken: they are given up, with their positions, so the next step follows the first row's
        sample, which is sure, rather than the last draft's."""
        prev = eng.lookahead.inflight
        for s in prev.spans if prev else ():
            req = s.req
            if s.guess >= 0 and s.live and s.start < req.seq_len and _token(req, s.start) != s.guess:
                self.record(req, len(s.draft), 0, s.bar)
                eng.recorder.speculated(req, len(s.draft), 0)
                eng.kv.trim(req, s.start + 1)
                req.num_allocated = s.start + 1
                s.draft, s.guess = [], -1

    @staticmethod
    def _ahead(eng: Engine) -> dict[int, list[int]]:
        """Per request in the step in flight: the tokens it assumes past the committed ones (its drafts)."""
        return {i: s.draft for i, s in eng.lookahead.live().items()}

    def _propose(self, req: Request, k: int, ahead: list[int] | None) -> tuple[int, list[int]]:
        """(guess, drafts). With `ahead` (a step is in flight), the first token proposed is a guess of the token that
        step samples, and the drafts follow it."""
        lookup = self._lookup(req)
        if ahead is None:
            return -1, lookup.propose(req.prompt_ids, req.output_ids, k)
        found = lookup.propose(req.prompt_ids, req.output_ids, k + 1, ahead)
        return (found[0], found[1:]) if len(found) > 1 else (-1, [])

    @staticmethod
    def _rows(eng: Engine, req: Request, draft: list[int], source: int) -> list[Row]:
        """The request's next token's row (`source`: its input's row in the step in flight; -1: the last token
        committed), then one per draft, each sampled as if the drafts before it were output already (min_tokens,
        bad words, penalties, the grammar's mask)."""
        first, p = eng._decode_row(req, source), req.num_allocated
        rows = [first]
        for j, token in enumerate(draft, 1):
            rows.append(replace(first, start=p + j, tokens=[token], prev=-1, slots=eng.kv.slots(req, p + j, p + j + 1),
                                groups=eng.kv.groups(req, p + j, p + j + 1), fed_output=False, counted=(),
                                ban=eng._ban(req, j), ban_later=req.ban_later(draft[:j]), drafts=tuple(draft[:j]),
                                grammar=req.grammar and req.grammar.ahead(draft[:j])))
        return rows

    def _lookup(self, req: Request) -> Lookup:
        lookup = self.lookups.get(req.id)
        if lookup is None:
            lookup = self.lookups[req.id] = Lookup(self.config, self.blanks)
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

    def drafts(self, ready: list[Request], width: int, room: dict[int, int],
               ahead: dict[int, list[int]] | None = None) -> dict[int, tuple[int, list[int]]]:
        """(guess, drafts) per request id, for the ready requests that find any; `width`: the batch's rows without
        drafts; `room`: how many tokens each request may still produce past the next one (max_tokens, context);
        `ahead`: the tokens the step in flight assumes, per request in it (drafts then follow a guess)."""
        out: dict[int, tuple[int, list[int]]] = {}
        ahead = ahead or {}
        for req in ready:
            pace = self.paces.get(req.id)
            if not self.pays(width):
                break
            guessing = req.id in ahead
            sampled = not req.params.greedy
            k = min(pace.length(self.config.k, width, self.costs, guessing, sampled) if pace else 1, self.rows - width,
                    room.get(req.id, 0))
            if k <= 0:
                continue
            if width >= self.costs.cheap and (pace.rate if pace else 0.5) < self.costs.worth(width + 1, sampled):
                self.shadow(req, ahead.get(req.id))   # a probe here costs more than the estimate says it could find
                continue
            guess, draft = self._propose(req, k, ahead.get(req.id))
            if draft and req.grammar is not None:          # only what the grammar takes: the rest would be refused
                draft = draft[:req.grammar.legal(draft)]
            if draft:
                out[req.id] = guess, draft
                width += len(draft)
                self.shadows.pop(req.id, None)        # its record now comes from the verify step
        return out

    def shadow(self, req: Request, ahead: list[int] | None) -> None:
        """Propose the request's next token without verifying it (`compare` scores it once it is sampled). Not
        behind drafts in flight (rejected, their position would be sampled after other tokens), nor a token the
        grammar refuses (no draft would carry it)."""
        if ahead:
            return
        found = self._lookup(req).propose(req.prompt_ids, req.output_ids, 1)
        if found and (req.grammar is None or req.grammar.legal(found)):
            self.shadows[req.id] = req.seq_len, found[0]

    def compare(self, batch: list[Request]) -> None:
        """Score the shadow drafts whose position has been sampled since."""
        for req in batch:
            if (shadow := self.shadows.get(req.id)) and shadow[0] < req.seq_len:
                del self.shadows[req.id]
                self.paces.setdefault(req.id, Pace()).count(1, int(_token(req, shadow[0]) == shadow[1]))

    def pays(self, width: int) -> bool:
        """Whether a row past a step of `width` rows fits in the pass and could pay, were its draft surely taken."""
        return width < self.rows and self.costs.worth(width + 1) < 1

    def record(self, req: Request, drafted: int, accepted: int, bar: float) -> None:
        self.paces.setdefault(req.id, Pace()).record(drafted, accepted, bar)

    def release(self, req: Request) -> None:
        self.lookups.pop(req.id, None)
        self.paces.pop(req.id, None)
        self.shadows.pop(req.id, None)



def _token(req: Request, position: int) -> int:
    return req.output_ids[position - len(req.prompt_ids)] if position >= len(req.prompt_ids) else \
        req.prompt_ids[position]
