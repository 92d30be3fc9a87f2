"""bench-peers arithmetic and output, without timing anything: rows, goals, the plot, the aggregate counter."""
from __future__ import annotations

import math
import statistics

from perf import bench_peers, bench_roofline
from perf.common import Pair, median_pair


def test_rows_carry_ratio_and_goal(tmp_path):
    met = bench_peers.row("lookahead vs sync", "torch small", 99.0, 100.0, 0.98)
    missed = bench_peers.row("in-process vs transformers", "tiny", 200.0, 100.0, 2.5)
    assert met["ratio"] == 0.99 and met["met"]
    assert missed["ratio"] == 2.0 and not missed["met"]
    assert math.isnan(bench_peers.row("x", "y", 1.0, 0.0, 1.0)["ratio"])
    bench_peers.plot([met, missed], tmp_path / "peers.png")
    assert (tmp_path / "peers.png").stat().st_size > 5_000


def test_aggregate_counts_tokens_after_every_request_has_started(tiny_dir):
    from engine.config import EngineConfig
    from engine.core.engine import Engine
    engine = Engine(EngineConfig(model=tiny_dir, max_batch_size=4, kv_storage="paged", num_threads=1))
    assert bench_peers.aggregate(engine, 2, 12) > 0
    assert bench_peers.aggregate(engine, 4, 12) > 0      # the engine is reused across rounds
    assert not engine.has_work and engine.pool.num_used == 0


def test_gemv_ceiling_reads_every_weight_matrix(tiny_dir, monkeypatch):
    import torch

    from engine.config import EngineConfig
    from engine.core.engine import Engine
    engine = Engine(EngineConfig(model=tiny_dir, dtype="float32", num_threads=1))
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, *a: seen.append(w.shape) or real(x, w, *a))
    assert bench_roofline.gemv_ceiling(engine, repeats=1) > 0
    model = engine.runner.model
    per_pass = 4 * len(model.layers) + 1                  # qkv, o, gate_up, down per layer, and the lm_head
    assert len(seen) == 2 * per_pass and torch.Size(model.embed.weight.shape) in seen   # the head, [V, H]


def test_median_pair_alternates_which_runs_first():
    calls = []
    a = lambda: calls.append("a") or 1.0 + len(calls)     # noqa: E731
    b = lambda: calls.append("b") or 100.0 + len(calls)   # noqa: E731
    pair = median_pair(a, b, 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert pair.pagoda == 5.5 and pair.peer == 104.5    # medians of a's (2, 5, 6, 9) and b's (102, 103, 106, 107)
    assert pair.ratio == (5 / 103 + 6 / 106) / 2        # the median of the per-pair ratios, not 5.5 / 104.5


def test_paired_row_takes_the_paired_ratio():
    r = bench_peers.paired_row("lookahead vs sync", "mlx small", Pair(120.0, 100.0, 1.1), "lookahead mlx")
    assert (r["pagoda"], r["peer"], r["ratio"], r["met"]) == (120.0, 100.0, 1.1, False)


def test_lookahead_row_switches_one_engine(tiny_dir, monkeypatch):
    engines, modes = set(), []

    def fake_run(engine, prompt, n, lookahead=None):
        engines.add(id(engine))
        modes.append(lookahead)
        return 0.0, 200.0 if lookahead else 100.0
    monkeypatch.setattr(bench_peers, "cached_model", lambda preset: tiny_dir)
    monkeypatch.setattr(bench_peers, "greedy_run", fake_run)
    pair = bench_peers.lookahead("tiny", "torch", 4, 2, 1)
    assert len(engines) == 1
    assert modes == [True, False, True, False, False, True]     # warm-up, then ABBA
    assert pair == Pair(200.0, 100.0, 2.0, 2.0, 2.0)


def test_roofline_pairs_each_decode_run_with_its_own_ceilings(tiny_dir, monkeypatch):
    # each run's roofline: the faster of a plain and a huge-page probe (300, 100, 200 bytes/s)
    huge = bench_roofline.hugepages.supported()
    probes = [300.0, 250.0, 80.0, 100.0, 200.0, 150.0] if huge else [300.0, 100.0, 200.0]
    events, rates, bandwidths = [], iter([0.0, 10.0, 20.0, 30.0]), iter(probes)          # 0.0: warm-up

    def fake_run(engine, prompt, n):
        events.append("decode")
        return 0.0, next(rates)

    def fake_bandwidth(x, reads=5):
        events.append("sum")
        return next(bandwidths)

    def fake_ceiling(engine, repeats=5, linear=None):
        events.append("pass")
        return 20.0
    monkeypatch.setattr(bench_roofline, "cached_model", lambda preset: tiny_dir)
    monkeypatch.setattr(bench_roofline, "greedy_run", fake_run)
    monkeypatch.setattr(bench_roofline, "sum_bandwidth", fake_bandwidth)
    monkeypatch.setattr(bench_roofline, "SUM_BYTES", 1 << 12)
    monkeypatch.setattr(bench_roofline, "gemv_ceiling", fake_ceiling)
    rows = bench_roofline.rows("tiny", 1, 4, 2)
    sums = ["sum", "sum"] if huge else ["sum"]
    assert events == ["decode"] + [*sums, "decode", "pass", "pass"] * 3      # warm-up, then 3 interleaved runs
    from engine.config import EngineConfig
    from engine.core.engine import Engine
    weights = sum(p.numel() * p.element_size()
                  for p in Engine(EngineConfig(model=tiny_dir, dtype="float32")).runner.model.parameters())
    roof = rows[0]
    per_run = [10.0 / (300 / weights), 20.0 / (100 / weights), 30.0 / (200 / weights)]
    assert roof["ratio"] == statistics.median(per_run) != 20.0 / (200 / weights)    # not the ratio of medians
    assert roof["pagoda"] == 20.0 and roof["peer"] == 200 / weights
    assert rows[1]["ratio"] == 1.0 and rows[2]["ratio"] == 1.0           # median rate 20 against a 20 tok/s pass
    assert len(rows) == 3


def test_the_mlx_lm_peer_is_installed_where_mlx_is():
    """`make setup` installs mlx-lm (without its dependencies) for the mlx-lm row; bench-peers would stop there
    without it."""
    import importlib.util

    import pytest
    pytest.importorskip("mlx.core")
    assert importlib.util.find_spec("mlx_lm") is not None


def test_family_rows_pair_each_preset_with_transformers_and_say_why_llama_cpp_is_absent(monkeypatch, capsys):
    from perf import bench_families
    monkeypatch.setattr(bench_families.llama_peer, "build", lambda: (None, "no compiler here"))
    rows = bench_families.rows(("tiny-gemma3",), 1, 6, 1)
    assert [(r["section"], r["what"]) for r in rows] == [("families vs transformers", "tiny-gemma3 bf16")]
    assert rows[0]["pagoda"] > 0 and rows[0]["peer"] > 0
    assert "llama.cpp family rows left out: no compiler here" in capsys.readouterr().out
