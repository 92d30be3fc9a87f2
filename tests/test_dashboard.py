"""deploy/grafana/pagoda.json: built by Grafana's typed builders (deploy/grafana/dashboard.py), loaded back by
Grafana's dashboard model, every query valid PromQL over series a replica exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
from grafana_foundation_sdk.models.dashboard import Dashboard

from deploy.grafana import dashboard
from engine.serving.metrics import Metrics

BOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pagoda.json"


def exprs(data: dict) -> list[str]:
    return [t["expr"] for p in data["panels"] for t in p.get("targets", [])]


def test_the_committed_dashboard_is_what_the_builder_makes():
    assert BOARD.read_text() == dashboard.render(), "run: python -m deploy.grafana.dashboard"


def test_it_loads_as_a_grafana_dashboard_and_every_query_reads_an_exported_series():
    data = json.loads(BOARD.read_text())
    board = Dashboard.from_json(data)
    assert board.title == "Pagoda" and len(board.panels) == len(data["panels"]) >= 10
    assert {v["name"] for v in data["templating"]["list"]} == {"datasource", "model_name"}
    exported = {name for name, _ in Metrics().series()}
    used = set()
    for expr in exprs(data):
        concrete = expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
        promql_parser.parse(concrete)                       # raises on invalid PromQL
        used |= set(re.findall(r"(vllm:[a-z0-9_]+|pagoda_[a-z0-9_]+)", concrete))
    assert used and used <= exported, used - exported
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert name in used
