"""The step loop: admit, prefill, decode through the lookahead machine, stream deltas, finish and log."""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable

from engine.config import EngineConfig
from engine.kv.block_pool import BlockPool
from engine.kv.dense import DenseKV
from engine.kv.paged import PagedKV, contiguity, cdiv
from engine.lookahead import Lookahead
from engine.metrics import Metrics
from engine.prompt_cache import PrefixCache
from engine.request import Delta, Request, Status
from engine.runners import make_runner
from engine.runners.base import ModelRunner, Row
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

log = logging.getLogger("pagoda")
_STATUS = {"stop": "completed", "length": "completed", "abort": "cancelled", "error": "error"}


class Engine:
    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.model is None:
            from engine.models.presets import cached_model
            config.model = str(cached_model("small", config.seed))
        self.runner = runner = runner or make_runner(config, config.model)     # first: it names a bad model dir
        self.tokenizer = Tokenizer(config.model)
        self.max_model_len = min(config.max_model_len or runner.max_model_len, runner.max_model_len)
        self.metrics = Metrics()
        self.pool: BlockPool | None = None
        if config.paged:
            num_blocks = config.num_kv_blocks or self._auto_blocks()
            runner.init_paged(num_blocks, config.block_size)
            self.pool = BlockPool(num_blocks, config.block_size, config.contiguous_blocks)
            self.kv: PagedKV | DenseKV = PagedKV(self.pool, PrefixCache(self.pool) if config.prompt_cache else None)
        else:
            store = config.prompt_cache_bytes if config.prompt_cache else None
            self.kv = DenseKV(runner, runner.bytes_per_token, store)
        self.scheduler = Scheduler(config, self.kv)
        self.lookahead = Lookahead(runner, config.use_lookahead)
        self.requests: dict[int, Request] = {}
        self.ids = itertools.count()
        self.cancels: deque[int] = deque()
        self.deltas: list[Delta] = []
        self.steps = 0
        # Fault injection for reliability tests: PAGODA_FAILPOINT_STEPS=5,9 makes those steps raise mid-step.
        self.failpoints = {int(n) for n in os.environ.get("PAGODA_FAILPOINT_STEPS", "").split(",") if n.strip()}
        # When set, each delta goes out the moment it exists (a prefill's first token does not wait for the
        # decode step launched in the same tick); otherwise step() returns them.
        self.on_delta: Callable[[Delta], None] | None = None

    def _auto_blocks(self) -> int:
        per_block = self.runner.bytes_per_token * self.config.block_size
        by_bytes = max(1, self.config.kv_cache_bytes // per_block)
        by_need = 4 * self.config.max_batch_size * cdiv(self.max_model_len, self.config.block_size)
        return min(by_bytes, by_need)

    # ---- requests in ----
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: int | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming the field. Thread-safe. `request_id`: for a caller that
        numbers all its requests itself (EngineProcess)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            field = "prompt"
        else:
            ids, field = list(prompt), "input_ids"
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.runner.vocab_size:
                    raise ValueError(f"input_ids: token id {t!r} is outside the vocabulary [0, {self.runner.vocab_size})")
        if not ids:
            raise ValueError(f"{field}: must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{field}: {len(ids)} tokens leave no room in the model's context of {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.max_model_len}")
        req = Request(next(self.ids) if request_id is None else request_id, ids, params)
        if not self.kv.fits(req):
            raise ValueError(f"{field}: {len(ids)} tokens need more KV blocks than the pool holds")
        req.detok = self.tokenizer.detokenizer()
        return req

    def add(self, req: Request) -> Request:
        self.scheduler.add(req)
        self.requests[req.id] = req
        return req

    def abort(self, request_id: int) -> None:
        """Cancel a request; it ends with finish_reason 'abort' within one tick. Thread-safe."""
        self.cancels.append(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.lookahead.inflight or self.cancels)

    # ---- one tick ----
    def step(self) -> list[Delta]:
        self.deltas = []
        self._reap_cancels()
        admitted, too_big = self.scheduler.admit()
        for req in admitted:
            self._on_admit(req)
        for req in too_big:
            self._finish(req, "error", "prompt: needs more KV blocks than the pool holds")
        self._prefill()
        self.steps += 1
        if self.steps in self.failpoints:
            raise RuntimeError(f"failpoint: injected failure in step {self.steps}")
        self._decode()
        self._gauges()
        return self.deltas

    def fail_all(self, message: str) -> list[Delta]:
        """End every request with an error after a failed step, leaving the engine ready for new work."""
        self.deltas = []
        self.lookahead.reset()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            req.num_allocated = req.num_computed
            self._finish(req, "error", message)
        self._gauges()
        return self.deltas

    def _reap_cancels(self) -> None:
        while self.cancels:
            req = self.requests.get(self.cancels.popleft())
            if req is not None and not req.finished:
                req.cancelled = True
                if req.in_flight == 0:
                    self._finish(req, "abort")

    def _on_admit(self, req: Request) -> None:
        if req.num_cached < 0:
            req.num_cached = req.num_computed
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))
            if self.config.prompt_cache:
                self.metrics.cache_queries.inc()
                if req.num_cached:
                    self.metrics.cache_hits.inc()
                    self.metrics.cached_tokens.inc(req.num_cached)

    def _prefill(self) -> None:
        plan = self.scheduler.prefill_plan()
        if not plan:
            return
        rows = []
        for req, n in plan:
            start, end = req.num_computed, req.num_computed + n
            ids = req.all_ids
            rows.append(Row(req.id, start, ids[start:end], slots=self.kv.slots(req, start, end),
                            block_table=req.block_table, buf=req.buf, params=req.params, ban=self._ban(req),
                            sample=end == req.prefill_target and not req.output_ids))
            req.num_allocated = end
        tokens = self.runner.fetch(self.runner.forward(rows, None))
        for (req, _), row, token in zip(plan, rows, tokens):
            req.num_computed = req.num_allocated
            self.kv.commit(req)
            if row.sample:
                self._append(req, token)

    def _decode(self) -> None:
        started = time.thread_time()
        batch = self._reserve()
        if batch:
            self.metrics.decode_steps.inc()
        before = self.lookahead.pipelined
        results = self.lookahead.tick(batch, self._decode_row)
        self.metrics.lookahead_steps.inc(self.lookahead.pipelined - before)
        cpu = time.thread_time() - started
        self.metrics.decode_cpu.inc(cpu)
        for req in batch:
            req.decode_cpu += cpu / len(batch)
        for req, token in results:
            self._commit(req, token)

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
                for req, token in self.lookahead.drain():
                    self._commit(req, token)
                drained = True
            elif len(self.scheduler.running) == 1:
                self._finish(self.scheduler.running[0], "error", "kv cache: the sequence outgrew the whole block pool")
            else:
                self.scheduler.preempt()
                self.metrics.preemptions.inc()

    def _decode_row(self, req: Request, prev: int) -> Row:
        p = req.num_allocated
        n_prompt = len(req.prompt_ids)
        tokens = [] if prev >= 0 else [req.prompt_ids[p] if p < n_prompt else req.output_ids[p - n_prompt]]
        return Row(req.id, p, tokens, prev=prev, slots=self.kv.slots(req, p, p + 1), block_table=req.block_table,
                   buf=req.buf, params=req.params, ban=self._ban(req))

    def _ban(self, req: Request) -> tuple[int, ...]:
        p = req.params
        if len(req.output_ids) + req.in_flight >= p.min_tokens:
            return ()
        return tuple(set(p.stop_token_ids) | set(self.runner.eos_token_ids))

    # ---- tokens out ----
    def _commit(self, req: Request, token: int) -> None:
        self.kv.commit(req)
        if req.cancelled:
            self._finish(req, "abort")
        else:
            self._append(req, token)

    def _append(self, req: Request, token: int) -> None:
        now = time.monotonic()
        if not req.output_ids:
            req.first_token_at = now
            self.metrics.observe("pagoda_time_to_first_token_seconds", now - req.arrival)
        req.last_token_at = now
        req.output_ids.append(token)
        self.metrics.generation_tokens.inc()
        p, n = req.params, len(req.output_ids)
        reason = None
        if token in p.stop_token_ids or (token in self.runner.eos_token_ids and not p.ignore_eos):
            reason = "stop"
        else:
            delta = req.detok.add(token)
            req.text += delta
            if p.stop and delta and n >= p.min_tokens:
                reason = self._match_stop(req, len(delta))
        if reason is None and (n >= p.max_tokens or req.seq_len >= self.max_model_len):
            req.text += req.detok.flush()
            reason = "length"
        if reason:
            self._finish(req, reason)
        else:
            self._emit(req)

    def _match_stop(self, req: Request, added: int) -> str | None:
        window = max(len(s) for s in req.params.stop) + added
        tail_start = max(0, len(req.text) - window)
        hits = [i for s in req.params.stop if (i := req.text.find(s, tail_start)) >= 0]
        if not hits:
            return None
        req.text = req.text[:min(hits)]
        return "stop"

    def _emit(self, req: Request, final: bool = False) -> None:
        end = len(req.text)
        if not final and req.params.stop:
            end = max(req.sent_text, end - max(len(s) for s in req.params.stop) + 1)
        delta = Delta(req.id, req.output_ids[req.sent_ids:], req.text[req.sent_text:end], final,
                      req.finish_reason, req.error, len(req.prompt_ids), len(req.output_ids), max(req.num_cached, 0))
        if self.on_delta is None:
            self.deltas.append(delta)
        else:
            self.on_delta(delta)
        req.sent_ids, req.sent_text = len(req.output_ids), end

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if self.lookahead.unwind(req, self.kv.trim):
            self.metrics.unwinds.inc()
        if self.pool is not None:
            self.metrics.count_table(*contiguity(req.block_table))
        self.scheduler.remove(req)
        self.runner.release(req.id)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        self.requests.pop(req.id, None)
        now = time.monotonic()
        self.metrics.requests.labels(status=_STATUS[reason]).inc()
        self.metrics.observe("pagoda_e2e_request_latency_seconds", now - req.arrival)
        decode, cpu = 0.0, 1000 * req.decode_cpu / max(1, len(req.output_ids) - 1)
        if len(req.output_ids) > 1 and req.last_token_at > req.first_token_at:
            per_token = (req.last_token_at - req.first_token_at) / (len(req.output_ids) - 1)
            self.metrics.observe("pagoda_time_per_output_token_seconds", per_token)
            decode = 1.0 / per_token
        ttft = (req.first_token_at - req.arrival) * 1000 if req.first_token_at else 0.0
        log.info("prompt-cache: request completed cached=%d/%d id=%d output=%d reason=%s ttft=%.1fms decode=%.1ftok/s "
                 "decode_cpu=%.2fms/tok",
                 max(req.num_cached, 0), len(req.prompt_ids), req.id, len(req.output_ids), reason, ttft, decode, cpu)
        self._gauges()          # before the final delta goes out: a front end may read the gauges on it
        self._emit(req, final=True)

    def _gauges(self) -> None:
        for state, n in self.kv.stats().items():
            self.metrics.kv_blocks.labels(state=state).set(n)
        self.metrics.batch_size.set(len(self.scheduler.running))
        self.metrics.queue_depth.set(len(self.scheduler.waiting))
