"""One registry of counters, gauges and histograms with the names every front end exports."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pagoda_requests", "Requests ended, by status", ["status"], registry=r)
        self.prompt_tokens = Counter("pagoda_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("pagoda_generation_tokens", "Tokens generated", registry=r)
        self.cache_queries = Counter("pagoda_prompt_cache_queries", "Prompt-cache lookups", registry=r)
        self.cache_hits = Counter("pagoda_prompt_cache_hits", "Lookups that adopted cached KV", registry=r)
        self.cached_tokens = Counter("pagoda_prompt_cache_cached_tokens", "Prompt tokens adopted", registry=r)
        self.decode_steps = Counter("pagoda_decode_steps", "Decode steps launched", registry=r)
        self.lookahead_steps = Counter("pagoda_decode_lookahead_steps",
                                       "Decode ticks that launched a step while the previous was in flight",
                                       registry=r)
        self.unwinds = Counter("pagoda_lookahead_unwinds", "Speculative positions unwound", registry=r)
        self.preemptions = Counter("pagoda_preemptions", "Requests sent back to the queue for recompute",
                                   registry=r)
        self.kv_blocks = Gauge("pagoda_kv_blocks", "KV blocks (dense: buffers) by state", ["state"], registry=r)
        self.batch_size = Gauge("pagoda_batch_size", "Requests running", registry=r)
        self.queue_depth = Gauge("pagoda_queue_depth", "Requests waiting", registry=r)
        self.ttft = Histogram("pagoda_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("pagoda_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("pagoda_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY, registry=r)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (counters by their exported `_total` name); 0 when absent."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def text(self) -> bytes:
        return generate_latest(self.registry)
