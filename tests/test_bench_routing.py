"""perf/bench_routing.py: the same tenants' requests in the same order for every policy, and a short run through
real replicas and vllm-router that prints, saves and plots what it measured."""
from __future__ import annotations

import json

import pytest

from perf import bench_routing
from scripts.cluster import ROUTER


def test_the_workload_is_the_same_for_every_policy_and_shares_each_tenants_prefix():
    a, b = bench_routing.workload(4, 20, 30), bench_routing.workload(4, 20, 30)
    assert a == b and len(a) == 20
    assert sorted(t for t, _ in a) == sorted([0, 1, 2, 3] * 5)
    first = [p for t, p in a if t == 0]
    system = bench_routing.system_prompt(0, 30)
    assert all(p.startswith(system) for p in first) and len(set(first)) == len(first)   # own question each
    assert not any(p.startswith(system) for t, p in a if t != 0)


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (make setup installs it)")
def test_a_short_run_measures_every_policy(tmp_path, tiny_dir):
    out, png = tmp_path / "routing.json", tmp_path / "routing.png"
    rows = bench_routing.main(["--model", tiny_dir, "--tenants", "2", "--requests", "8", "--concurrency", "2",
                               "--system-words", "40", "--kv-blocks", "64",
                               "--policies", "round_robin,kv_aware+session",
                               "--json", str(out), "--plot", str(png), "--", "--dtype", "float32"])
    assert [r["policy"] for r in rows] == ["round_robin", "kv_aware+session"]
    for r in rows:
        assert r["errors"] == 0 and sum(r["served"]) == 8 and 0 <= r["hit_rate"] <= 1
        assert r["queried_tokens"] > 0 and r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0
    assert rows[0]["served"] == [4, 4]                             # round robin alternates
    assert all(n % 4 == 0 for n in rows[1]["served"])              # each tenant's 4 requests stay on one replica
    assert json.loads(out.read_text())["rows"][1]["policy"] == "kv_aware+session" and png.stat().st_size > 0


def test_an_unknown_policy_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_routing.main(["--policies", "round_robin,sticky"])
    assert "--policies: unknown policy 'sticky'" in capsys.readouterr().err
