"""The step loop: admit, prefill, decode through the lookahead machine, finish. Every delta leaves through
`on_delta` the moment it exists (a prefill's first token does not wait for the decode step launched after it)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.admission import Admission
from engine.core.intake import Intake
from engine.core.lookahead import Lookahead, Result
from engine.core.ngram import Blanks, NgramConfig
from engine.core.output import Delta, Output
from engine.core.recorder import Recorder
from engine.core.request import Request, Status
from engine.core.sampling import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.speculate import Costs, Speculator
from engine.kv.base import KVStorage
from engine.kv.block_pool import BlockPool
from engine.kv.dense import DenseKV
from engine.kv.layout import Layout
from engine.kv.paged import PagedKV, contiguity
from engine.kv.prefix_cache import PrefixCache
from engine.kv.sizing import pool_blocks
from engine.runners import make_runner
from engine.runners.base import ModelRunner, Row, TokenLogprobs
from engine.serving.metrics import Metrics
from engine.tokenizer import Tokenizer


def _unset(delta: Delta) -> None:
    raise RuntimeError("engine: set on_delta before stepping")


class Engine:
    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None,
                 on_delta: Callable[[Delta], None] = _unset) -> None:
        self.config = config = config or EngineConfig()
        if config.model is None:
            from engine.models.presets import cached_model
            config.model = str(cached_model("small", config.seed))
        self.runner = runner = runner or make_runner(config, config.model)     # first: it names a bad model dir
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        self.max_model_len = min(config.max_model_len or runner.max_model_len, runner.max_model_len)
        runner.max_model_len = self.max_model_len        # the longest sequence served sizes what the runner holds
        self.metrics = Metrics(config.model_name)
        self.recorder = Recorder(self.metrics, config.prompt_cache)
        self.output = Output(self.tokenizer.stop_ids(runner.eos_token_ids), self.max_model_len, self.tokenizer)
        self.pool: BlockPool | None = None
        self.kv_events, self.publisher = self._publisher()
        self.kv: KVStorage = self._storage()
        self.scheduler = Scheduler(config, self.kv)
        self.admission = Admission(config.max_queue, config.max_queue_wait)
        self.lookahead = Lookahead(runner, config.use_lookahead)
        ngram = NgramConfig.parse(config.speculative_config)
        self.spec = Speculator(ngram, runner.step_rows, Costs(runner.cheap_rows, *(runner.row_costs() or ())),
                               runner.overlaps and config.use_lookahead,
                               Blanks.of(*self.tokenizer.layout())) if ngram else None
        if ngram:
            self.metrics.spec_positions(ngram.k)
        self.on_delta = on_delta
        self.requests: dict[int, Request] = {}
        self.intake = Intake(config, runner, self.tokenizer, self.kv, self.max_model_len)
        self.forking: list[Request] = []             # first sequences whose prefill their forks wait for
        self.cancels: deque[int] = deque()
        self.steps = 0
        self.failpoints = config.failpoints
        self.hit_delay = config.hit_decode_delay
        self._gauges()                  # every series exists before the first request: the pool's size, free

    def _storage(self) -> KVStorage:
        config, runner = self.config, self.runner
        if not config.paged:
            return DenseKV(runner, runner.bytes_per_token, config.prompt_cache_bytes if config.prompt_cache else None)
        layout = Layout.of(runner.windows, not config.disable_hybrid_kv_cache_manager)
        num_blocks = config.num_kv_blocks or pool_blocks(config, runner, self.max_model_len, layout)
        runner.init_paged(num_blocks, config.block_size, layout)
        cache = PrefixCache(config.block_size, self.kv_events) if config.prompt_cache else None
        self.pool = BlockPool(num_blocks, config.block_size, config.contiguous_blocks, cache)
        return PagedKV(self.pool, cache, runner.copy_block, layout, config.prefill_chunk)

    def _publisher(self):
        """KV events: the prompt cache's log, and the thread that sends it. A fresh engine first says its cache
        is empty, so a router forgets what an engine before it (a restarted process) held."""
        if not self.config.kv_events:
            return None, None
        from engine.kv.events import BlockEvents
        from engine.serving.kv_publisher import Publisher
        c = self.config
        events, publisher = BlockEvents(), Publisher(c.kv_events_endpoint, c.kv_events_topic, c.block_size)
        events.cleared()
        return events, publisher

    def publish(self) -> None:
        """Hand this step's KV events to the publisher (called at the end of each step)."""
        if self.kv_events is not None and self.kv_events.pending:
            self.publisher.publish(self.kv_events.drain())

    # ---- requests in ----
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: int | None = None) -> Request:
        """Validate and tokenize (engine/core/intake.py); raises ValueError naming the field. Thread-safe.
        `request_id`: for a caller that numbers its requests itself."""
        return self.intake.make(prompt, params, request_id)

    def add(self, req: Request) -> Request:
        self.scheduler.add(req)
        for seq in req.group or [req]:
            self.requests[seq.id] = seq
        if req.forks:
            self.forking.append(req)
        return req

    def abort(self, request_id: int) -> None:
        """Cancel a request; it ends with finish_reason 'abort' within one tick. Thread-safe."""
        self.cancels.append(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.lookahead.inflight or self.cancels)

    # ---- one tick ----
    def step(self) -> None:
        self._reap_cancels()
        admitted, too_big = self.scheduler.admit()
        if admitted:
            self.admission.leave(len(admitted), time.monotonic())
        for req in admitted:
            self.recorder.admitted(req)
        for req in too_big:
            self._finish(req, "error", "prompt: needs more KV blocks than the pool holds")
        self._prefill()
        self._fork()
        self.steps += 1
        if self.steps in self.failpoints:
            raise RuntimeError(f"failpoint: injected failure in step {self.steps}")
        self._decode()
        self._gauges()
        self.publish()

    def fail_all(self, message: str) -> None:
        """End every request with an error after a failed step, leaving the engine ready for new work."""
        self.lookahead.reset()
        self.kv.withdraw()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            req.num_allocated = req.num_computed
            if not req.finished:            # a first sequence's pending forks end with it
                self._finish(req, "error", message)
        self._gauges()

    def _reap_cancels(self) -> None:
        while self.cancels:
            first = self.requests.get(self.cancels.popleft())
            for req in () if first is None else first.group or [first]:
                if not req.finished:
                    req.cancelled = True
                    if req.in_flight == 0:
                        self._finish(req, "abort")

    def _prefill(self) -> None:
        # a sliding layer group gets its blocks chunk by chunk (engine/kv/paged.py)
        plan = [(req, n) for req, n in self.scheduler.prefill_plan() if self.kv.grow(req, req.num_computed + n)]
        if not plan:
            return
        rows = []
        for req, n in plan:
            start, end = req.num_computed, req.num_computed + n
            n_prompt = len(req.prompt_ids)
            asks = req.prompt_logprobs is not None and len(req.prompt_logprobs) < n_prompt and n_prompt > 1
            rows.append(Row(req.id, start, req.all_ids[start:end], slots=self.kv.slots(req, start, end),
                            block_table=req.block_table, groups=self.kv.groups(req, start, end), buf=req.buf,
                            params=req.params, ban=self._ban(req),
                            sample=end == req.prefill_target and not req.output_ids and req.group is None,
                            prompt=req.penalty_prompt, grammar=req.grammar, ban_later=req.ban_later(),
                            prompt_logprobs=req.params.prompt_logprobs if asks else None,
                            next_token=req.prompt_ids[end] if end < n_prompt else -1))
            req.num_allocated = end
            self.kv.announce(req, end)
        self.publish()                  # routers hear of the prompt's blocks as this step starts, as vLLM's do
        handle = self.runner.forward(rows, None)
        self.runner.sample(handle)
        sampled = self.runner.fetch(handle)
        logprobs = sampled.logprobs or [None] * len(rows)
        for i, ((req, _), row, token, lp) in enumerate(zip(plan, rows, sampled.tokens, logprobs)):
            req.num_computed = req.num_allocated
            self.kv.commit(req)
            if row.prompt_logprobs is not None:
                self.output.add_prompt_logprobs(req, row.start, sampled.prompt_logprobs[i])
            if row.sample:
                self._append(req, token, lp)

    def _fork(self) -> None:
        """Sequences whose first sequence's prefill is done share its KV and join the batch; each then samples its
        first token in its own decode step (fed the prompt's last token), with its own sampler state."""
        for first in [r for r in self.forking if r.finished or (r.status is Status.RUNNING and not r.prefilling)]:
            self.forking.remove(first)
            for seq in first.forks if not first.finished else ():
                self.kv.fork(first, seq)
                seq.num_computed = seq.num_allocated = first.num_computed
                seq.num_cached, seq.arrival = first.num_cached, first.arrival
                self.scheduler.join(seq)
            first.forks = []

    def _decode(self) -> None:
        if self.spec is not None and self.spec.step(self):
            return
        started = time.thread_time()
        batch = self._reserve()
        before = self.lookahead.pipelined
        results = self.lookahead.tick(batch, self._decode_row)
        if self.hit_delay and any(r.num_cached > 0 for r in batch):
            time.sleep(self.hit_delay)          # the hit-only decode penalty failpoint (config.hit_decode_delay)
        self.recorder.decode_tick(batch, time.thread_time() - started, self.lookahead.pipelined - before)
        self._take(results)
        self.lookahead.sample_pending()

    def _wants_step(self, req: Request) -> bool:
        ahead = len(req.output_ids) + req.in_flight
        return not req.cancelled and ahead < req.params.max_tokens and req.seq_len + req.in_flight < self.max_model_len

    def _reserve(self) -> list[Request]:
        """The decode batch with KV room for one more position each: drain, then preempt, when the pool is short."""
        drained = False
        while True:
            batch = [r for r in self.scheduler.decoding() if self._wants_step(r)]
            if all(self.kv.grow(r, r.num_allocated + 1) for r in batch):
                return batch
            if not drained:
                self._take(self.lookahead.drain())
                drained = True
            elif len(self.scheduler.running) == 1:
                self._finish(self.scheduler.running[0], "error", "kv cache: the sequence outgrew the whole block pool")
            else:
                self.scheduler.preempt()
                self.metrics.preemptions.inc()
                self.metrics.vllm.preemptions.inc()

    def _decode_row(self, req: Request, prev: int) -> Row:
        p = req.num_allocated
        n_prompt = len(req.prompt_ids)
        tokens = [] if prev >= 0 else [req.prompt_ids[p] if p < n_prompt else req.output_ids[p - n_prompt]]
        return Row(req.id, p, tokens, prev=prev, slots=self.kv.slots(req, p, p + 1), block_table=req.block_table,
                   groups=self.kv.groups(req, p, p + 1), buf=req.buf, params=req.params, ban=self._ban(req),
                   fed_output=p >= n_prompt, prompt=req.penalty_prompt, grammar=req.grammar,
                   ban_later=req.ban_later(), counted=req.take_uncounted())

    def _ban(self, req: Request, ahead: int = 0) -> tuple[int, ...]:
        """The tokens a row `ahead` positions past the request's next one may not sample."""
        p = req.params
        always = req.bad_words.always if req.bad_words else ()
        if len(req.output_ids) + req.in_flight + ahead >= p.min_tokens:
            return always
        return tuple(set(p.stop_token_ids) | self.output.eos_token_ids | set(always))

    # ---- tokens out ----
    def _take(self, results: list[Result]) -> None:
        for span, tokens, lps in results:
            if span.draft:
                self.spec.accept(self, span, tokens, lps)
            else:
                span.req.num_computed += 1
                self._commit(span.req, tokens[0], lps[0])

    def _commit(self, req: Request, token: int, lp: TokenLogprobs | None) -> None:
        self.kv.commit(req)
        if req.cancelled:
            self._finish(req, "abort")
        else:
            self._append(req, token, lp)

    def _append(self, req: Request, token: int, lp: TokenLogprobs | None) -> None:
        self.recorder.token(req)
        reason = self.output.append(req, token, lp)
        if reason:
            self._finish(req, reason, req.error)
        else:
            self.on_delta(self.output.delta(req))

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        forks, req.forks = req.forks, []
        if self.spec is not None:
            self.spec.release(req)
        if self.lookahead.unwind(req, self.kv.trim):
            self.metrics.unwinds.inc()
        table = contiguity(req.block_table) if self.pool is not None else None
        self.scheduler.remove(req)
        self.runner.release(req.id)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        self.requests.pop(req.id, None)
        self.recorder.finished(req, table)
        self._gauges()          # before the final delta goes out: a front end may read the gauges on it
        self.on_delta(self.output.delta(req, final=True))
        for seq in forks:       # never forked: they end as their first sequence did
            self._finish(seq, reason, error)

    def _gauges(self) -> None:
        self.recorder.gauges(self.kv.stats(), len(self.scheduler.running), len(self.scheduler.waiting))
