"""One registry of counters, gauges and histograms with the names every front end exports.

Front ends without access to this registry's HTTP exposition (Triton's Python backend) copy it with `Mirror`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()      # no *_created series: they are noise on every scrape

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")       # vLLM's FinishReason values


class Metrics:
    """Every series exists from the start: counters at 0 for each label value they take, gauges at 0 until the
    engine sets them, histograms empty; a scrape of an idle server shows them all and rate() sees the first
    increment."""
    STATUSES = ("completed", "cancelled", "error", "refused")       # refused: at admission (Overloaded)
    KV_STATES = ("free", "used", "cached")

    def __init__(self, model_name: str = "pagoda") -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pagoda_requests", "Requests ended, by status", ["status"], registry=r)
        for status in self.STATUSES:
            self.requests.labels(status=status)
        self.prompt_tokens = Counter("pagoda_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("pagoda_generation_tokens", "Tokens generated", registry=r)
        self.cache_queries = Counter("pagoda_prompt_cache_queries", "Prompt-cache lookups", registry=r)
        self.cache_hits = Counter("pagoda_prompt_cache_hits", "Lookups that adopted cached KV", registry=r)
        self.cached_tokens = Counter("pagoda_prompt_cache_cached_tokens", "Prompt tokens adopted", registry=r)
        self.decode_steps = Counter("pagoda_decode_steps", "Decode steps launched", registry=r)
        self.lookahead_steps = Counter("pagoda_decode_lookahead_steps",
                                       "Decode ticks that launched a step while the previous was in flight",
                                       registry=r)
        self.decode_cpu = Counter("pagoda_decode_cpu_seconds",
                                  "CPU time of the engine thread in decode ticks (host work; on CPU also the "
                                  "model's when torch runs on one thread)", registry=r)
        self.unwinds = Counter("pagoda_lookahead_unwinds", "Speculative positions unwound", registry=r)
        self.preemptions = Counter("pagoda_preemptions", "Requests sent back to the queue for recompute",
                                   registry=r)
        self.spec_drafts = Counter("pagoda_spec_decode_drafts", "Speculative drafts verified (a sequence's draft "
                                   "tokens in one step)", registry=r)
        self.spec_draft_tokens = Counter("pagoda_spec_decode_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter("pagoda_spec_decode_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_per_pos = Counter("pagoda_spec_decode_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                    "their position in the draft (0: the first)", ["position"], registry=r)
        self.kv_blocks = Gauge("pagoda_kv_blocks", "KV blocks (dense: buffers) by state", ["state"], registry=r)
        for state in self.KV_STATES:
            self.kv_blocks.labels(state=state)
        self.table_pairs = Counter("pagoda_block_table_pairs", "Adjacent block-table entries of finished "
                                   "requests (paged)", registry=r)
        self.table_consecutive = Counter("pagoda_block_table_consecutive_pairs", "Of those, pairs whose block "
                                         "ids are consecutive", registry=r)
        self.contiguity = Gauge("pagoda_block_table_contiguity", "Fraction of adjacent block-table entries that "
                                "are consecutive ids, over finished requests (paged; 1 before any)", registry=r)
        self.contiguity.set(1.0)
        self.tables = [0, 0]          # adjacent pairs, consecutive pairs: the gauge's running totals
        self.restarts = Counter("pagoda_engine_restarts", "Times the engine was started again after it died",
                                registry=r)
        self.batch_size = Gauge("pagoda_batch_size", "Requests running", registry=r)
        self.queue_depth = Gauge("pagoda_queue_depth", "Requests waiting", registry=r)
        self.buckets = {"pagoda_time_to_first_token_seconds": LATENCY,
                        "pagoda_time_per_output_token_seconds": PER_TOKEN,
                        "pagoda_decode_cpu_seconds_per_output_token": PER_TOKEN,
                        "pagoda_e2e_request_latency_seconds": LATENCY}
        self.histograms = {
            "pagoda_time_to_first_token_seconds": Histogram(
                "pagoda_time_to_first_token_seconds", "Time to first token", buckets=LATENCY, registry=r),
            "pagoda_time_per_output_token_seconds": Histogram(
                "pagoda_time_per_output_token_seconds", "Mean time per output token after the first, per request",
                buckets=PER_TOKEN, registry=r),
            "pagoda_decode_cpu_seconds_per_output_token": Histogram(
                "pagoda_decode_cpu_seconds_per_output_token", "Engine-thread CPU time of a request's decode ticks "
                "(its share of each) per output token after the first, per request", buckets=PER_TOKEN, registry=r),
            "pagoda_e2e_request_latency_seconds": Histogram(
                "pagoda_e2e_request_latency_seconds", "Request latency", buckets=LATENCY, registry=r),
        }
        self.histogram_labels: dict[str, dict[str, str]] = {}
        self.vllm = VllmSeries(self, model_name)
        self.observations: deque[tuple[str, float]] = deque(maxlen=100_000)   # for mirrors to replay
        self.seen: dict[tuple[str, tuple], float] = {}      # apply: the other registry's counters, last snapshot
        self.families = {m.describe()[0].name: m for m in vars(self).values() if isinstance(m, (Counter, Gauge))}
        self.families |= self.vllm.families

    def restarted(self) -> None:
        """The other registry (a new engine process) starts from 0: count its gains from there."""
        self.restarts.inc()
        self.seen.clear()

    def spec_positions(self, k: int) -> None:
        """Speculation drafts up to k tokens: the per-position series exist from the start."""
        for i in range(k):
            self.spec_per_pos.labels(position=str(i))
            self.vllm.spec_per_pos.labels(**self.vllm.labels, position=str(i))

    def speculated(self, drafted: int, accepted: int) -> None:
        """One sequence's draft of `drafted` tokens verified, its first `accepted` taken."""
        v = self.vllm
        for mine, theirs, n in ((self.spec_drafts, v.spec_drafts, 1), (self.spec_draft_tokens, v.spec_draft_tokens,
                                                                      drafted),
                                (self.spec_accepted, v.spec_accepted, accepted)):
            mine.inc(n)
            theirs.inc(n)
        for i in range(accepted):
            self.spec_per_pos.labels(position=str(i)).inc()
            v.spec_per_pos.labels(**v.labels, position=str(i)).inc()

    def series(self) -> list[tuple[str, dict[str, str]]]:
        """Every exported series (name, labels): what a scrape of an idle server shows."""
        return [(s.name, s.labels) for fam in self.registry.collect() for s in fam.samples]

    def count_table(self, pairs: int, consecutive: int) -> None:
        """A finished request's block table, toward the contiguity counters and gauge."""
        self.table_pairs.inc(pairs)
        self.table_consecutive.inc(consecutive)
        self.tables = [self.tables[0] + pairs, self.tables[1] + consecutive]
        if self.tables[0]:
            self.contiguity.set(self.tables[1] / self.tables[0])

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)
        self.observations.append((name, value))

    def snapshot(self) -> tuple[list[tuple[str, str, dict[str, str], float]], list[tuple[str, float]]]:
        """Counter and gauge samples, and the observations made since the last snapshot (it takes them), for
        `apply` in another process."""
        samples = [(fam.type, s.name, s.labels, s.value) for fam in self.registry.collect()
                   if fam.type in ("counter", "gauge") for s in fam.samples
                   if fam.type == "gauge" or s.name.endswith("_total")]
        taken = [self.observations.popleft() for _ in range(len(self.observations))]
        return samples, taken

    def apply(self, snapshot: tuple[list, list]) -> None:
        """Bring this registry to another's `snapshot`: counters up by what the other gained since its last
        snapshot, gauges set, observations replayed."""
        samples, observations = snapshot
        for kind, name, labels, value in samples:
            family = name.removesuffix("_total") if kind == "counter" else name
            metric = self.families[family].labels(**labels) if labels else self.families[family]
            if kind == "gauge":
                metric.set(value)
                continue
            key = (name, tuple(sorted(labels.items())))
            gained = value - self.seen.get(key, 0.0)
            self.seen[key] = value
            if gained > 0:
                metric.inc(gained)
        for name, value in observations:
            self.observe(name, value)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (counters by their exported `_total` name); 0 when absent."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Mirror:
    """Copies the registry into another metrics API on each `sync()`: counters by increment, gauges by value (each
    only when it changed), histograms by replaying observations. `family(name, description, kind)` must return an
    object whose `Metric(labels=..., buckets=...)` has increment/set/observe, the shape of Triton's
    pb_utils.MetricFamily."""

    def __init__(self, metrics: Metrics, family: Callable[..., Any], kinds: dict[str, Any],
                 labels: dict[str, str]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.families: dict[str, Any] = {}
        self.series: dict[tuple[str, tuple], Any] = {}
        self.last: dict[tuple[str, tuple], float] = {}
        for fam in metrics.registry.collect():
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            self.families[name] = family(name=name, description=fam.documentation, kind=kinds[fam.type])
        metrics.observations.clear()
        for name in metrics.histograms:              # empty histograms export from the start too
            self._metric(name, metrics.histogram_labels.get(name, {}))

    def _metric(self, name: str, labels: dict[str, str]) -> Any:
        key = (name, tuple(sorted(labels.items())))
        if key not in self.series:
            extra = {"buckets": list(self.metrics.buckets[name])} if name in self.metrics.buckets else {}
            self.series[key] = self.families[name].Metric(labels={**self.labels, **labels}, **extra)
        return self.series[key]

    def sync(self) -> None:
        for fam in self.metrics.registry.collect():
            if fam.type not in ("counter", "gauge"):
                continue                                # histograms replay their observations below
            for s in fam.samples:
                if fam.type == "counter" and not s.name.endswith("_total"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                series = self._metric(s.name, s.labels)             # made at 0 on the first sync
                if fam.type == "counter" and s.value != self.last.get(key, 0.0):
                    series.increment(s.value - self.last.get(key, 0.0))
                elif fam.type == "gauge" and s.value != self.last.get(key):   # each a round trip to tritonserver
                    series.set(s.value)
                else:
                    continue
                self.last[key] = s.value
        while self.metrics.observations:
            name, value = self.metrics.observations.popleft()
            self._metric(name, self.metrics.histogram_labels.get(name, {})).observe(value)


class VllmSeries:
    """The vLLM names that routers, autoscalers and vLLM's Grafana dashboard read, beside the pagoda_* series, with
    vLLM's labels (model_name, engine) and semantics (its metrics design doc, vllm/v1/metrics/loggers.py): prefix
    cache queries and hits count tokens, KV usage is the fraction of blocks held by running requests (cached
    blocks no request holds count as free, as vLLM's evictable blocks do), inter-token latency is observed per
    token."""

    def __init__(self, metrics: Metrics, model_name: str) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.families: dict[str, Counter | Gauge] = {}
        self.running = self._family(Gauge, "vllm:num_requests_running", "Number of requests in model execution "
                                    "batches.", metrics)
        self.waiting = self._family(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be "
                                    "processed.", metrics)
        self.kv_usage = self._family(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                                     "usage.", metrics)
        self.cache_queries = self._family(Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of "
                                          "number of queried tokens.", metrics)
        self.cache_hits = self._family(Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number "
                                       "of cached tokens.", metrics)
        self.prompt_tokens = self._family(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                                          metrics)
        self.generation_tokens = self._family(Counter, "vllm:generation_tokens", "Number of generation tokens "
                                              "processed.", metrics)
        self.preemptions = self._family(Counter, "vllm:num_preemptions", "Cumulative number of preemption from "
                                        "the engine.", metrics)
        self.spec_drafts = self._family(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                        metrics)
        self.spec_draft_tokens = self._family(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft "
                                              "tokens.", metrics)
        self.spec_accepted = self._family(Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted "
                                          "tokens.", metrics)
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Number of accepted tokens "
                                    "per draft position.", [*self.labels, "position"], registry=metrics.registry)
        self.families["vllm:spec_decode_num_accepted_tokens_per_pos"] = self.spec_per_pos
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*self.labels, "finished_reason"], registry=metrics.registry)
        self.families["vllm:request_success"] = success
        self.success = {reason: success.labels(**self.labels, finished_reason=reason) for reason in FINISH_REASONS}
        for name, doc, buckets in (
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", VLLM_ITL),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", VLLM_E2E),
                ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                 VLLM_E2E)):
            family = Histogram(name, doc, list(self.labels), buckets=buckets, registry=metrics.registry)
            metrics.histograms[name] = family.labels(**self.labels)
            metrics.buckets[name] = buckets
            metrics.histogram_labels[name] = self.labels

    def _family(self, cls: type, name: str, doc: str, metrics: Metrics):
        family = cls(name, doc, list(self.labels), registry=metrics.registry)
        self.families[name] = family
        return family.labels(**self.labels)
