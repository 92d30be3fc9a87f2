"""Per-request and per-tick accounting: the metrics registry and the one log line per completed request."""
from __future__ import annotations

import logging
import time

from engine.core.request import Request
from engine.serving.metrics import Metrics

log = logging.getLogger("pagoda")
STATUS = {"stop": "completed", "length": "completed", "abort": "cancelled", "error": "error"}   # -> Metrics.STATUSES


class Recorder:
    def __init__(self, metrics: Metrics, prompt_cache: bool) -> None:
        self.metrics = metrics
        self.prompt_cache = prompt_cache

    def admitted(self, req: Request) -> None:
        """A request's first admission: its prompt and what it adopted from the prompt cache."""
        if req.num_cached >= 0:
            return                              # readmitted after a preemption: counted already
        m, v = self.metrics, self.metrics.vllm
        req.num_cached = req.num_computed
        m.prompt_tokens.inc(len(req.prompt_ids))
        v.prompt_tokens.inc(len(req.prompt_ids))
        if self.prompt_cache:
            m.cache_queries.inc()
            v.cache_queries.inc(len(req.prompt_ids))          # vLLM counts both in tokens
            v.cache_hits.inc(req.num_cached)
            if req.num_cached:
                m.cache_hits.inc()
                m.cached_tokens.inc(req.num_cached)

    def token(self, req: Request) -> None:
        """A token is about to be appended to the request."""
        now, m = time.monotonic(), self.metrics
        if not req.output_ids:
            req.first_token_at = now
            if req.group is None or not any(s.output_ids for s in req.group):     # a request's first token
                m.observe("pagoda_time_to_first_token_seconds", now - req.arrival)
                m.observe("vllm:time_to_first_token_seconds", now - req.arrival)
        else:
            m.observe("vllm:inter_token_latency_seconds", now - req.last_token_at)
        req.last_token_at = now
        m.generation_tokens.inc()
        m.vllm.generation_tokens.inc()

    def decode_tick(self, batch: list[Request], cpu: float, pipelined: int) -> None:
        """A decode tick that launched a step for `batch` (`pipelined`: 1 if it launched with a step in flight)
        and took `cpu` seconds of this thread."""
        m = self.metrics
        if batch:
            m.decode_steps.inc()
        m.lookahead_steps.inc(pipelined)
        m.decode_cpu.inc(cpu)
        for req in batch:
            req.decode_cpu += cpu / len(batch)

    def speculated(self, req: Request, drafted: int, accepted: int) -> None:
        req.drafted += drafted
        req.accepted += accepted
        self.metrics.speculated(drafted, accepted)

    def finished(self, req: Request, table: tuple[int, int] | None) -> None:
        """A sequence ended (its finish_reason set); `table`: its block table's contiguity (paged). A request is
        counted, and logged, when its last sequence ends (n > 1: with the output of all of them)."""
        m, now, reason = self.metrics, time.monotonic(), req.finish_reason
        if table is not None:
            m.count_table(*table)
        decode, cpu = req.decode_timing() or (0.0, 0.0)
        if decode:
            m.observe("pagoda_time_per_output_token_seconds", 1.0 / decode)
            m.observe("pagoda_decode_cpu_seconds_per_output_token", cpu / 1000)
            m.observe("vllm:request_decode_time_seconds", req.last_token_at - req.first_token_at)
        seqs = req.group or [req]
        if not all(s.finished or s is req for s in seqs):
            return
        m.requests.labels(status=STATUS[reason]).inc()
        m.vllm.success[reason].inc()
        m.observe("pagoda_e2e_request_latency_seconds", now - req.arrival)
        m.observe("vllm:e2e_request_latency_seconds", now - req.arrival)
        first = min((s.first_token_at for s in seqs if s.first_token_at), default=0.0)
        ttft = (first - req.arrival) * 1000 if first else 0.0
        width = f" n={len(seqs)}" if req.group else ""
        drafted = sum(s.drafted for s in seqs)
        spec = f" accepted={sum(s.accepted for s in seqs)}/{drafted}" if drafted else ""
        log.info("prompt-cache: request completed cached=%d/%d id=%d output=%d%s reason=%s ttft=%.1fms "
                 "decode=%.1ftok/s decode_cpu=%.2fms/tok%s", max(req.num_cached, 0), len(req.prompt_ids),
                 req.group_id, sum(len(s.output_ids) for s in seqs), width, reason, ttft, decode, cpu, spec)

    def gauges(self, kv: dict[str, int], running: int, waiting: int) -> None:
        m = self.metrics
        for state, n in kv.items():
            m.kv_blocks.labels(state=state).set(n)
        m.batch_size.set(running)
        m.queue_depth.set(waiting)
        total = sum(kv.values())
        m.vllm.kv_usage.set(kv.get("used", 0) / total if total else 0.0)
        m.vllm.running.set(running)
        m.vllm.waiting.set(waiting)
