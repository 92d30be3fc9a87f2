"""The Grafana dashboard of a Pagoda deployment, built with Grafana's own typed builders (grafana-foundation-sdk),
from the vLLM-named series every replica exports (so it reads vLLM replicas too) and a few pagoda_* ones.

    python -m deploy.grafana.dashboard            # rewrites deploy/grafana/pagoda.json
"""
from __future__ import annotations

from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder

OUT = Path(__file__).with_name("pagoda.json")
SEL = '{model_name=~"$model_name"}'


def quantiles(name: str) -> list[tuple[str, str]]:
    by = f"sum by (le) (rate({name}_bucket{SEL}[$__rate_interval]))"
    return [(f"histogram_quantile({q}, {by})", f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests running and waiting", "short", [
        (f"sum by (instance) (vllm:num_requests_running{SEL})", "running {{instance}}"),
        (f"sum by (instance) (vllm:num_requests_waiting{SEL})", "waiting {{instance}}")]),
    ("KV cache usage", "percentunit", [(f"vllm:kv_cache_usage_perc{SEL}", "{{instance}}")]),
    ("Prefix-cache hit rate (tokens)", "percentunit", [
        (f"sum by (instance) (rate(vllm:prefix_cache_hits_total{SEL}[$__rate_interval])) / "
         f"sum by (instance) (rate(vllm:prefix_cache_queries_total{SEL}[$__rate_interval]))", "{{instance}}")]),
    ("Time to first token", "s", quantiles("vllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("vllm:inter_token_latency_seconds")),
    ("End-to-end request latency", "s", quantiles("vllm:e2e_request_latency_seconds")),
    ("Token throughput", "short", [
        (f"sum(rate(vllm:prompt_tokens_total{SEL}[$__rate_interval]))", "prompt tokens/s"),
        (f"sum(rate(vllm:generation_tokens_total{SEL}[$__rate_interval]))", "generation tokens/s")]),
    ("Finished requests by reason", "reqps", [
        (f"sum by (finished_reason) (rate(vllm:request_success_total{SEL}[$__rate_interval]))",
         "{{finished_reason}}")]),
    ("Lookahead: decode steps launched with one in flight", "percentunit", [
        ("sum(rate(pagoda_decode_lookahead_steps_total[$__rate_interval])) / "
         "sum(rate(pagoda_decode_steps_total[$__rate_interval]))", "pipelined")]),
]
STATS = [("Engine restarts", "sum(pagoda_engine_restarts_total)"),
         ("Preemptions", f"sum(vllm:num_preemptions_total{SEL})")]


def build() -> dashboard.Dashboard:
    board = (dashboard.Dashboard("Pagoda").uid("pagoda").tags(["pagoda", "vllm"]).refresh("10s")
             .time("now-30m", "now").timezone("browser")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
             .with_variable(dashboard.QueryVariable("model_name").label("Model")
                            .query("label_values(vllm:num_requests_running, model_name)")
                            .datasource(prometheus_source()).multi(True).include_all(True)))
    for i, (title, unit, queries) in enumerate(PANELS):
        panel = timeseries.Panel().title(title).unit(unit).datasource(prometheus_source()).height(8).span(12)
        for j, (expr, legend) in enumerate(queries):
            panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABC"[j]))
        board = board.with_panel(panel)
    for title, expr in STATS:
        board = board.with_panel(stat.Panel().title(title).datasource(prometheus_source()).height(4).span(6)
                                 .with_target(prometheus.Dataquery().expr(expr).ref_id("A")))
    return board


def prometheus_source():
    from grafana_foundation_sdk.models.dashboard import DataSourceRef
    return DataSourceRef(type_val="prometheus", uid="${datasource}")


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
