"""The benchmarks' arithmetic, prompt construction and the perf_analyzer comparison, without a server."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from client.stream import Result, _apply
from client.workload import NONCE, Workload
from perf import compare
from perf.bench_serving import Sample, pairs, summarize, table
from perf.common import bootstrap_interval

DATA = Path(__file__).parent / "data"


def test_decode_rate_uses_token_arrival_times():
    r = Result(start=10.0)
    for t, ids in ((10.5, [1]), (10.6, [2, 3]), (11.1, [4])):      # two tokens may arrive in one response
        _apply(r, {"output_ids": ids}, t)
    assert r.ttft == pytest.approx(0.5)
    assert r.decode_rate == pytest.approx(3 / 0.6)                  # (4 tokens - 1) / (11.1 - 10.5)
    assert math.isnan(Result(start=0.0, token_times=[1.0]).decode_rate)


def sample(kind: str, pair: int, rate: float, ttft: float, c: int = 1, cpu: float = 5.0) -> Sample:
    return Sample(c, pair, kind, ttft, rate, 100, 471, 448 if kind == "hit" else 0, 98.0, cpu,
                  0.95 if kind == "hit" else 1.0, None, rate * 1.01, cpu)


def test_summary_medians_ranges_and_ratios_with_intervals():
    samples = [sample("miss", 0, 100, 0.2), sample("hit", 0, 99, 0.02, cpu=4.8), sample("miss", 1, 110, 0.3),
               sample("hit", 1, 112, 0.03, cpu=4.9), sample("miss", 2, 90, 0.25), sample("hit", 2, 90, 0.025)]
    s = summarize(samples)[1]
    assert s["miss"]["decode_tok_s"] == [100, 90, 110]
    assert s["hit"]["engine_decode_tok_s"] == pytest.approx([99.99, 90.9, 113.12])
    assert s["hit"]["ttft_ms"] == pytest.approx([25, 20, 30])
    logs = sorted(math.log(r) for r in (0.99, 112 / 110, 1.0))
    assert s["client_decode"]["value"] == pytest.approx(math.exp(sum(logs) / 3))     # 3 pairs: nothing trimmed
    assert s["engine_decode"]["value"] == pytest.approx(s["client_decode"]["value"])
    lo, hi = s["client_decode"]["ci95"]
    assert lo <= s["client_decode"]["value"] <= hi and s["client_decode"]["pairs"] == 3
    assert s["engine_cpu"]["value"] == pytest.approx(math.exp((math.log(0.96) + math.log(0.98)) / 3))
    assert s["hit"]["cached"] == 448 and s["hit"]["prompt_tokens"] == 471
    text = table({1: s})
    assert "448/471" in text and "0.950" in text and f"engine decode {s['engine_decode']['value']:.3f} (" in text


def test_pairs_average_within_a_pair():
    samples = [sample("miss", 0, 100, 0.1, c=2), sample("miss", 0, 200, 0.1, c=2),
               sample("hit", 0, 150, 0.1, c=2), sample("hit", 0, 150, 0.1, c=2)]
    assert pairs(samples, 2, "decode_tok_s") == [(150, 150)]


def test_bootstrap_interval_brackets_the_median_and_shrinks_with_agreement():
    spread = [0.9, 0.95, 1.0, 1.02, 1.05, 1.1, 0.97, 1.01]
    lo, hi = bootstrap_interval(spread)
    assert min(spread) <= lo <= sorted(spread)[4] and sorted(spread)[3] <= hi <= max(spread)
    assert hi - lo < max(spread) - min(spread)
    assert bootstrap_interval([1.0] * 8) == (1.0, 1.0)
    assert all(math.isnan(v) for v in bootstrap_interval([1.0]))


def test_miss_prompts_never_share_a_block_and_hits_share_the_intended_prefix():
    w = Workload(471, suffix=23, seed=5)
    misses = [w.miss() for _ in range(200)]
    assert all(len(m) == 471 for m in misses)
    assert len({m[0] for m in misses}) == 200                    # no two share even their first token
    assert len({tuple(m[:32]) for m in misses}) == 200           # so no first block is shared
    for m in misses[:20]:
        h = w.hit(m)
        assert len(h) == 471 and h[:448] == m[:448] and h[448] != m[448]
        assert (min(448, 470) // 32) * 32 == 448                 # what paged storage adopts
    with pytest.raises(ValueError, match="suffix"):
        Workload(100, suffix=100)
    assert NONCE < 471


def interleave(miss: dict, hit: dict) -> dict:
    """One export whose requests alternate MISS, HIT (as perf_hit_miss's input data makes them), from two recorded
    exports; each HIT is moved to just after its MISS, its timestamps shifted alike."""
    requests = []
    for m, h in zip(miss["experiments"][0]["requests"], hit["experiments"][0]["requests"]):
        shift = m["response_timestamps"][-1] + 1000 - h["timestamp"]
        h = {**h, "timestamp": h["timestamp"] + shift,
             "response_timestamps": [t + shift for t in h["response_timestamps"]]}
        for r in (m, h):        # the engine's own timing rides on the last response
            requests.append(r)
            r["response_outputs"][-1] = {**r["response_outputs"][-1], "decode_tok_s": 100.0 + len(requests),
                                         "decode_cpu_ms": 2.0}
    return {"experiments": [{"requests": requests}]}


def test_compare_pairs_an_interleaved_perf_analyzer_export(tmp_path):
    miss = json.loads((DATA / "pa_miss.json").read_text())
    hit = json.loads((DATA / "pa_hit.json").read_text())
    export = interleave(miss, hit)
    c = compare.compare(export)
    first = export["experiments"][0]["requests"][1]
    ts = first["response_timestamps"]
    assert len(c["miss"]) == len(c["hit"]) == 2
    assert c["hit"][0]["ttft_ms"] == pytest.approx((ts[0] - first["timestamp"]) / 1e6)
    assert c["hit"][0]["decode_tok_s"] == pytest.approx(4 / ((ts[-1] - ts[0]) / 1e9))
    assert c["hit"][0]["cached_tokens"] == 32 and c["miss"][0]["cached_tokens"] == 0
    assert [r["engine_decode_tok_s"] for r in c["miss"] + c["hit"]] == [101, 103, 102, 104]
    assert c["engine_decode"]["pairs"] == 2 and c["engine_cpu"]["value"] == pytest.approx(1.0)
    assert compare.compare(export, warmup=1)["engine_decode"]["pairs"] == 1
    assert compare.compare([export, export])["engine_decode"]["pairs"] == 4
    # a HIT whose MISS is missing (perf_analyzer's count cut the run) pairs with nothing
    lone = {"experiments": [{"requests": export["experiments"][0]["requests"][1:]}]}
    assert len(compare.compare(lone)["hit"]) == 1
    assert "engine decode 1.0" in compare.table(c) and "(" in compare.table(c).splitlines()[-1]
    compare.plot(c, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_openai_stream_client_parses_sse():
    """stream_openai against a loopback stand-in that speaks the OpenAI completions SSE format."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from client.stream import stream_openai
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"text": "Hel", "token_ids": [5], "finish_reason": None}]},
                      {"choices": [{"text": "lo", "token_ids": [6, 7], "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}]
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass
    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = stream_openai(f"127.0.0.1:{server.server_port}", "m", [1, 2, 3], {"max_tokens": 3, "temperature": 0,
                                                                               "ignore_eos": True})
    finally:
        server.shutdown()
    assert seen["body"]["prompt"] == [1, 2, 3] and seen["body"]["stream"] is True and seen["body"]["ignore_eos"]
    assert (r.text, r.ids, r.finish_reason) == ("Hello", [5, 6, 7], "length")
    assert (r.num_input_tokens, r.cached_tokens) == (40, 32) and len(r.token_times) == 3


def test_bench_features_prints_each_feature_against_its_baseline(capsys):
    from perf import bench_features
    rows = bench_features.main(["--preset", "tiny", "--max-tokens", "12", "--repeats", "1"])
    assert [r[0] for r in rows] == [*bench_features.FEATURES, "json schema", "json schema", 'tool_choice "auto"']
    assert rows[-2][1] == "json schema, lookahead off" and all(float(r[4].split()[0]) > 0 for r in rows)
    assert "n=4 (aggregate)" in capsys.readouterr().out
    only = bench_features.main(["--preset", "tiny", "--max-tokens", "4", "--repeats", "1", "--only", "tool"])
    assert [r[0] for r in only] == ['tool_choice "auto"']


def test_an_empty_perf_analyzer_export_is_run_again_on_fresh_prompts(tmp_path, monkeypatch, capsys):
    """perf_analyzer 2.51 now and then exits 0 with its export empty: the run is repeated on new prompts (the
    earlier try's may be cached by then), and a run that never writes one stops with the file named. The input
    alternates MISS and HIT, each HIT sharing all but its last tokens with the MISS before it."""
    from argparse import Namespace

    from perf import perf_hit_miss
    inputs, writes = [], iter(["", '{"experiments": []}'])

    def fake_run(url, model, data, export, requests, version="1"):
        inputs.append((json.loads(data.read_text()), requests))
        export.write_text(next(writes, ""))
        return export.stat().st_size > 0
    monkeypatch.setattr(perf_hit_miss, "perf_analyzer", fake_run)
    args = Namespace(url="u", model="llm", model_version="1")
    w = Workload(40, 8, seed=1)
    got = perf_hit_miss.profile(args, w, 3, {"max_tokens": 4}, tmp_path / "pa_run.json")
    assert got == {"experiments": []} and len(inputs) == 2 and inputs[0][1] == 6
    first, second = ([d["input_ids"]["content"] for d in run["data"]] for run, _ in inputs)
    assert len(first) == len(second) == 6 and not set(map(tuple, first)) & set(map(tuple, second))
    for miss, hit in zip(first[::2], first[1::2]):
        assert hit[:32] == miss[:32] and hit != miss and miss[0] not in {m[0] for m in first[::2] if m is not miss}
    assert all(d["return_decode_timing"] == [True] for d in inputs[0][0]["data"])
    assert "left pa_run.json empty; running it again" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="left .*pa_again.json empty 3 times"):
        perf_hit_miss.profile(args, w, 2, {"max_tokens": 4}, tmp_path / "pa_again.json")


def test_bench_spec_prints_each_workload_against_speculation_off(tiny_dir, tmp_path, capsys):
    from perf import bench_spec
    rows = bench_spec.main(["--model", tiny_dir, "--ks", "2", "--pairs", "1", "--max-tokens", "8", "--concurrency",
                            "1", "2", "--out", str(tmp_path / "spec")])
    assert [(r["workload"], r["concurrency"]) for r in rows] == [(w, c) for w in bench_spec.WORKLOADS for c in (1, 2)]
    assert all(r["ratio"] > 0 and r["low"] <= r["ratio"] <= r["high"] for r in rows)
    assert (tmp_path / "spec.json").exists() and (tmp_path / "spec.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "proposer on a 16,384-token prompt" in out and "control (sampled free writing)" in out
    assert "rows as the engine priced them at load: k=2: " in out


def test_bench_spec_lockstep_times_each_engine_on_its_own_steps(tiny_dir, monkeypatch):
    import types

    from engine.config import EngineConfig
    from engine.core.engine import Engine
    from perf import bench_spec
    clock, seen = [0.0], []
    monkeypatch.setattr(bench_spec, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engines = [Engine(EngineConfig(model=tiny_dir, max_batch_size=2)) for _ in range(2)]
    for name, e, cost in (("a", engines[0], 1.0), ("b", engines[1], 3.0)):    # seconds a step, on a fake clock
        def step(step=e.step, name=name, cost=cost):
            step()
            seen.append(name)
            clock[0] += cost
        e.step = step
    a, b = bench_spec.lockstep(engines, [[5, 6, 7, 8]] * 2, 6, first=1)
    # two requests' token a step once both have their first (from the prefill step), on each engine's own clock
    assert (a.rate, a.ttft, b.rate, b.ttft) == (2.0, 1.0, 2 / 3, 3.0)
    assert seen == ["b", "a", "a", "b"] * 3 and a.drafted == b.drafted == 0


def test_bench_rows_times_every_row_count(tiny_dir, capsys):
    from perf import bench_rows
    times = bench_rows.main(["--model", tiny_dir, "--rows", "1", "3", "--repeats", "2", "--tokens", "6"])
    assert set(times) == {1, 3} and all(len(t) == 2 and all(ms > 0 for ms in t) for t in times.values())
    out = capsys.readouterr().out
    assert "x the fewest rows' step" in out and out.count("\n") >= 4


def test_bench_rows_pairs_the_kernels_of_a_commit_against_these(tiny_dir, capsys):
    import subprocess

    from engine.kernels import cpu_build
    from perf import bench_rows
    here = list(cpu_build.SOURCES)
    with bench_rows.kernels_at("HEAD"):
        theirs = cpu_build.SOURCES
        assert [p.name for p in theirs] == [p.name for p in here] and theirs[0].parent != here[0].parent
        shown = subprocess.run(["git", "show", "HEAD:engine/kernels/cpu_quant.cpp"], capture_output=True,
                               check=True, cwd=here[0].parent).stdout
        assert next(p for p in theirs if p.name == "cpu_quant.cpp").read_bytes() == shown
    assert cpu_build.SOURCES == here
    ratios = bench_rows.main(["--model", tiny_dir, "--rows", "1", "2", "--repeats", "2", "--tokens", "6",
                              "--against", "HEAD"])
    assert set(ratios) == {1, 2} and all(len(r) == 2 and all(x > 0 for x in r) for r in ratios.values())
    assert "HEAD's step / this one's" in capsys.readouterr().out


def test_spec_bound_replays_the_proposals_against_the_step_costs():
    from perf.spec_bound import replay
    prompt = list(range(10, 18))
    out = list(prompt)               # repeated: nothing matches until (10, 11), then 4 drafts, then the last token
    flat = {1: 1.0, 32: 1.0}         # every step the same cost: the bound is tokens a step
    assert replay(prompt, out, flat, 1, 4, False) == 8 / 4
    rows = {1: 1.0, 32: 32.0}        # every row a one-row step's cost: drafts win nothing
    assert replay(prompt, out, rows, 1, 4, False) == 8 / (1 + 1 + 5 + 1)
    assert replay(prompt, out, flat, 1, 8, False) == 8 / 3          # after (10, 11): 5 drafts, the last one sampled
    assert replay(prompt, out, flat, 4, 4, False) == 8 / 4         # c rows a step, against c rows
    assert 1.0 <= replay(prompt, out, flat, 1, 4, True) <= 2.0      # the engine's lengths: no better than the bound
    assert 1.0 <= replay(prompt, out, flat, 4, 4, True) <= 2.0      # four sequences, each in turn
    assert replay(prompt, out, rows, 4, 4, True) <= 1.0 and replay(prompt, out, flat, 4, 4, True, most=4) == 1.0


def test_spec_bound_replays_re_indented_code_with_the_engine_proposer():
    from engine.core.ngram import Blanks
    from perf.spec_bound import replay
    nl, s4, s8 = 9, 1, 2
    prompt = [50, nl, s8, 60, 61, nl, s8, 62, 63, nl, s8, 64, 65, nl]
    out = [nl, s4, 60, 61, nl, s4, 62, 63, nl, s4, 64, 65, nl]        # the prompt's lines 4 columns to the left
    flat, blanks = {1: 1.0, 32: 1.0}, Blanks.of({s4: "    ", s8: "        "})
    exact, loose = replay(prompt, out, flat, 1, 8, False), replay(prompt, out, flat, 1, 8, False, blanks=blanks)
    assert loose > exact


def test_spec_bound_prints_policy_and_bound_per_workload(tiny_dir, capsys):
    from perf import bench_spec, spec_bound
    rows = spec_bound.main(["--model", tiny_dir, "--max-tokens", "8", "--k", "2"])
    assert [(r[0], r[1]) for r in rows] == [(w, c) for w in bench_spec.WORKLOADS if w not in bench_spec.SAMPLED
                                            for c in (1, 4)]
    assert all(float(x) > 0 for r in rows for x in r[3:7])   # the policy and its bound, loose matching and exact
    assert "a step's ms by rows: 1: " in capsys.readouterr().out
