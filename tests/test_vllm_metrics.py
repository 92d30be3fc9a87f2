"""The vLLM metric names routers, autoscalers and vLLM's Grafana dashboard read, beside the pagoda_* series: names
and types as vLLM documents them, its labels, and its semantics (prefix-cache queries and hits in tokens)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.serving.metrics import Metrics
from tests.helpers import greedy, random_ids

# From vLLM's docs: docs/design/metrics.md ("v1 Metrics") and docs/usage/metrics.md (Production Metrics), as
# exported (a counter's samples carry _total).
DOCUMENTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
}


def families(metrics: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.text().decode())}


def test_documented_names_are_exported_with_vllms_types_and_labels():
    found = families(Metrics("served"))
    for name, kind in DOCUMENTED.items():
        assert name in found and found[name].type == kind, name
        for sample in found[name].samples:
            assert sample.labels["model_name"] == "served" and sample.labels["engine"] == "0", sample
    exported = {s.name for f in found.values() for s in f.samples}
    assert {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:request_success_total"} <= exported
    reasons = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}


def test_counts_follow_vllms_semantics(tiny_dir):
    engine = Engine(EngineConfig(model=tiny_dir, kv_storage="paged", block_size=16, dtype="float32",
                                 served_model_name="tenant-model"))
    engine.on_delta = lambda d: None
    m, labels = engine.metrics, {"model_name": "tenant-model", "engine": "0"}
    first, second = random_ids(45, seed=1), random_ids(45, seed=1)[:40] + random_ids(9, seed=2)
    engine.add(engine.make_request(first, greedy(6)))
    engine.step()                                           # the prefill: one request running, blocks held
    assert m.value("vllm:num_requests_running", **labels) == 1
    assert 0 < m.value("vllm:kv_cache_usage_perc", **labels) < 1
    while engine.has_work:
        engine.step()
    engine.add(engine.make_request(second, greedy(4)))
    while engine.has_work:
        engine.step()
    assert m.value("vllm:prefix_cache_queries_total", **labels) == 45 + 49      # tokens queried
    assert m.value("vllm:prefix_cache_hits_total", **labels) == 32              # two blocks of 16 adopted
    assert m.value("vllm:prompt_tokens_total", **labels) == 45 + 49
    assert m.value("vllm:generation_tokens_total", **labels) == 6 + 4
    assert m.value("vllm:request_success_total", finished_reason="length", **labels) == 2
    assert m.value("vllm:time_to_first_token_seconds_count", **labels) == 2
    assert m.value("vllm:inter_token_latency_seconds_count", **labels) == 5 + 3  # one per token after the first
    assert m.value("vllm:e2e_request_latency_seconds_count", **labels) == 2
    assert m.value("vllm:num_requests_running", **labels) == 0
    assert m.value("vllm:kv_cache_usage_perc", **labels) == 0                    # cached blocks count as free


def test_a_copy_in_another_process_gets_the_same_series():
    """The front end's registry (serving/process.py) is brought to the engine's by snapshots."""
    child, front = Metrics("m"), Metrics("m")
    labels = {"model_name": "m", "engine": "0"}
    child.vllm.cache_queries.inc(40)
    child.vllm.running.set(3)
    child.observe("vllm:time_to_first_token_seconds", 0.2)
    front.apply(child.snapshot())
    assert front.value("vllm:prefix_cache_queries_total", **labels) == 40
    assert front.value("vllm:num_requests_running", **labels) == 3
    assert front.value("vllm:time_to_first_token_seconds_count", **labels) == 1
