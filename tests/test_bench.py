"""The benchmarks' arithmetic, prompt construction and the perf_analyzer comparison, without a server."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from client.stream import Result, _apply
from client.workload import NONCE, Workload
from perf import compare
from perf.bench_serving import Sample, paired_ratio, summarize, table
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
                  0.95 if kind == "hit" else 1.0)


def test_summary_medians_ranges_and_ratios():
    samples = [sample("miss", 0, 100, 0.2), sample("hit", 0, 99, 0.02, cpu=4.8), sample("miss", 1, 110, 0.3),
               sample("hit", 1, 112, 0.03, cpu=4.9), sample("miss", 2, 90, 0.25), sample("hit", 2, 90, 0.025)]
    s = summarize(samples)[1]
    assert s["miss"]["decode_tok_s"] == [100, 90, 110]
    assert s["hit"]["ttft_ms"] == pytest.approx([25, 20, 30])
    assert s["decode_ratio"] == pytest.approx(99 / 100)
    assert s["ttft_ratio"] == pytest.approx(25 / 250)
    assert s["paired_decode_ratio"] == pytest.approx(sorted([0.99, 112 / 110, 1.0])[1])
    assert s["hit"]["cached"] == 448 and s["hit"]["prompt_tokens"] == 471
    assert s["decode_cpu_ratio"] == pytest.approx(4.9 / 5.0)
    assert s["hit"]["contiguity"] == pytest.approx(0.95) and "0.950" in table({1: s})
    assert "448/471" in table({1: s})


def test_paired_ratio_averages_within_a_pair():
    samples = [sample("miss", 0, 100, 0.1, c=2), sample("miss", 0, 200, 0.1, c=2),
               sample("hit", 0, 150, 0.1, c=2), sample("hit", 0, 150, 0.1, c=2)]
    assert paired_ratio(samples, 2) == pytest.approx(1.0)


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


def test_compare_recorded_perf_analyzer_exports(tmp_path):
    miss = json.loads((DATA / "pa_miss.json").read_text())
    hit = json.loads((DATA / "pa_hit.json").read_text())
    c = compare.compare(miss, hit)
    first = hit["experiments"][0]["requests"][0]
    ts = first["response_timestamps"]
    assert c["hit"][0]["ttft_ms"] == pytest.approx((ts[0] - first["timestamp"]) / 1e6)
    assert c["hit"][0]["decode_tok_s"] == pytest.approx(4 / ((ts[-1] - ts[0]) / 1e9))
    assert c["hit"][0]["cached_tokens"] == 32 and c["miss"][0]["cached_tokens"] == 0
    assert c["decode_ratio"] == pytest.approx(c["hit_decode_tok_s"][0] / c["miss_decode_tok_s"][0])
    pooled = compare.compare([miss, miss], [hit])
    assert len(pooled["miss"]) == 2 * len(c["miss"])
    assert "hit/miss: decode" in compare.table(c)
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
    assert [r[0] for r in rows] == [*bench_features.FEATURES, "json schema", "json schema"]
    assert rows[-1][1] == "json schema, lookahead off" and all(float(r[4]) > 0 for r in rows)
    assert "n=4 (aggregate)" in capsys.readouterr().out


def test_an_empty_perf_analyzer_export_is_run_again_on_fresh_prompts(tmp_path, monkeypatch, capsys):
    """perf_analyzer 2.51 now and then exits 0 with its export empty: the run is repeated on new prompts (the
    earlier try's may be cached by then), and a run that never writes one stops with the file named."""
    from argparse import Namespace

    from perf import perf_hit_miss
    inputs, writes = [], iter(["", '{"experiments": []}'])

    def fake_run(url, model, data, export, requests, version="1"):
        inputs.append(json.loads(data.read_text()))
        export.write_text(next(writes, ""))
        return export.stat().st_size > 0
    monkeypatch.setattr(perf_hit_miss, "perf_analyzer", fake_run)
    args = Namespace(url="u", model="llm", model_version="1")
    w = Workload(40, 8, seed=1)
    got = perf_hit_miss.profile(args, w, w.miss(), "miss", 2, {"max_tokens": 4}, tmp_path / "pa_miss_0.json")
    assert got == {"experiments": []} and len(inputs) == 2
    first, second = ([d["input_ids"]["content"] for d in run["data"]] for run in inputs)
    assert len(first) == len(second) == 6 and not set(map(tuple, first)) & set(map(tuple, second))
    assert "left pa_miss_0.json empty; running it again" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="left .*pa_hit_0.json empty 3 times"):
        perf_hit_miss.profile(args, w, w.miss(), "hit", 2, {"max_tokens": 4}, tmp_path / "pa_hit_0.json")
