"""The main job (`make run`; `make bench` at full length): for paged storage (max_batch_size 4) and dense storage
(max_batch_size 1), start tritonserver, stream one request with client.stream, run the alternate hit/miss
benchmark and the perf_analyzer comparison, stop the server; then print one summary table. JSON and plots go
under --out (perf/results/ by default)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from perf import bench_serving as bench
from perf import perf_hit_miss
from perf.common import ROOT, range_cell, table
from scripts.tritonserver import launch

STORAGES = {"paged": {"PAGODA_KV_STORAGE": "paged", "PAGODA_MAX_BATCH_SIZE": "4"},
            "dense": {"PAGODA_KV_STORAGE": "dense", "PAGODA_MAX_BATCH_SIZE": "1"}}


def one_storage(name: str, args: argparse.Namespace, out: Path) -> dict:
    env = {**STORAGES[name], "PAGODA_NUM_THREADS": str(args.num_threads), "PAGODA_DTYPE": args.dtype}
    if args.preset:
        from engine.models.presets import cached_model
        args.model = str(cached_model(args.preset))
    if args.model:
        env["PAGODA_MODEL"] = args.model
    started = time.monotonic()
    server = launch(env, out / f"tritonserver_{name}.log")
    print(f"\n== {name}: tritonserver ready in {time.monotonic() - started:.1f}s (grpc {server.grpc_url})", flush=True)
    try:
        prompt = (ROOT / "engine/models/corpus.txt").read_text(encoding="utf-8")[:600]
        subprocess.run([sys.executable, "-m", "client.stream", "--url", server.grpc_url, "--prompt", prompt,
                        "--max-tokens", "32"], check=True, cwd=ROOT)
        concurrency = args.concurrency if name == "paged" else "1"
        report = bench.main(["--url", server.grpc_url, "--metrics-url", server.metrics_url,
                             "--concurrency", concurrency, "--prompt-tokens", str(args.prompt_tokens),
                             "--max-tokens", str(args.max_tokens), "--pairs", str(args.pairs), "--mode", "alternate",
                             "--json", str(out / f"bench_{name}.json"), "--plot", str(out / f"bench_{name}.png"),
                             "--title", f"{name}: alternate hit/miss through Triton gRPC streaming"])
        print(f"-- {name}: perf_analyzer, {args.perf_requests} requests each")
        pa = perf_hit_miss.main(["--url", server.grpc_url, "--prompt-tokens", str(args.prompt_tokens),
                                 "--max-tokens", str(args.max_tokens), "--requests", str(args.perf_requests),
                                 "--out", str(out / f"pa_{name}")])
    finally:
        server.stop()
    return {"bench": report["summary"], "perf_analyzer": {k: v for k, v in pa.items() if k not in ("miss", "hit")}}


def summary_table(results: dict) -> str:
    """bench rows measure everything; perf_analyzer rows leave out what it cannot see (the server's counters)."""
    rows = []
    for name, r in results.items():
        row = r["bench"][1]
        m, h = row["miss"], row["hit"]
        lo, hi = row["paired_decode_ci95"]
        rows.append([name, "bench c=1", f"{m['ttft_ms'][0]:.1f}", f"{h['ttft_ms'][0]:.1f}", f"{row['ttft_ratio']:.3f}",
                     range_cell(m["decode_tok_s"]), range_cell(h["decode_tok_s"]), f"{row['decode_ratio']:.3f}",
                     f"{row['paired_decode_ratio']:.3f} ({lo:.3f}-{hi:.3f})",
                     f"{int(h['cached'])}/{int(h['prompt_tokens'])}", f"{h['lookahead_steps']:.0f}",
                     f"{m['decode_cpu_ms']:.3f}/{h['decode_cpu_ms']:.3f}",
                     f"{m['contiguity']:.2f}/{h['contiguity']:.2f}"])
        pa = r["perf_analyzer"]
        rows.append([name, "perf_analyzer", f"{pa['miss_ttft_ms'][0]:.1f}", f"{pa['hit_ttft_ms'][0]:.1f}",
                     f"{pa['ttft_ratio']:.3f}", range_cell(pa["miss_decode_tok_s"]),
                     range_cell(pa["hit_decode_tok_s"]), f"{pa['decode_ratio']:.3f}", "", "", "", "", ""])
    header = ["storage", "source", "TTFT miss ms", "TTFT hit ms", "TTFT h/m", "decode miss tok/s",
              "decode hit tok/s", "h/m", "paired (95% CI)", "cached", "la/req", "cpu ms/tok m/h", "contig m/h"]
    return table(header, rows, left=2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded small model)")
    ap.add_argument("--preset", default=None, help="a preset made and cached on first use, e.g. qwen2.5-0.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=471)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--concurrency", default="1,2", help="levels for paged storage (dense runs at 1)")
    ap.add_argument("--perf-requests", type=int, default=8)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads in the server: 1 leaves a core "
                                                                 "to the client and Triton on a 2-core machine")
    ap.add_argument("--out", default=str(ROOT / "perf/results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = {name: one_storage(name, args, out) for name in STORAGES}
    text = summary_table(results)
    print(f"\n== summary: prompt {args.prompt_tokens} tokens (HIT shares all but 23), {args.max_tokens} new tokens, "
          f"greedy; {args.pairs} alternate pairs after 1 warm-up pair; medians (min-max)\n{text}")
    print(f"\nwall time {time.monotonic() - started:.0f}s; JSON and plots in {out}")
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    (out / "summary.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
