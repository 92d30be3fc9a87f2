"""The main job (`make run`; `make bench` at full length): for paged storage (max_batch_size 4) and dense storage
(max_batch_size 1), start tritonserver, stream one request with client.stream, run the alternate hit/miss
benchmark and perf_analyzer on interleaved hit/miss prompts, stop the server; then print one summary table, every
hit/miss ratio with its 95% interval, and one verdict per storage. JSON and plots go under --out (perf/results/ by
default).

The verdict pools the concurrency-1 pairs of both sources. It is decided by the engine's own decode timing (first to
last sampled token, in the engine process: free of the transport), and the client's, what a user sees through
gRPC, follows: see perf/verdict.py for the rule.
"""
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
from perf.verdict import TOLERANCE, Ratio, call, ratio, verdict
from scripts.tritonserver import launch

STORAGES = {"paged": {"PAGODA_KV_STORAGE": "paged", "PAGODA_MAX_BATCH_SIZE": "4"},
            "dense": {"PAGODA_KV_STORAGE": "dense", "PAGODA_MAX_BATCH_SIZE": "1"}}


def one_storage(name: str, args: argparse.Namespace, out: Path) -> dict:
    env = {**STORAGES[name], "PAGODA_NUM_THREADS": str(args.num_threads), "PAGODA_DTYPE": args.dtype}
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
                             "--warmup", str(args.warmup), "--settle", str(args.settle),
                             "--min-pairs", str(args.min_pairs), "--deadline", str(args.deadline),
                             "--json", str(out / f"bench_{name}.json"), "--plot", str(out / f"bench_{name}.png"),
                             "--title", f"{name}: alternate hit/miss through Triton gRPC streaming"])
        print(f"-- {name}: perf_analyzer, {args.perf_pairs} interleaved pairs", flush=True)
        pa = perf_hit_miss.main(["--url", server.grpc_url, "--prompt-tokens", str(args.prompt_tokens),
                                 "--max-tokens", str(args.max_tokens), "--pairs", str(args.perf_pairs),
                                 "--warmup", str(args.warmup), "--out", str(out / f"pa_{name}")])
    finally:
        server.stop()
    samples = [bench.Sample(**s) for s in report["samples"]]
    pooled = {key: [*bench.pairs(samples, 1, field), *((m[field], h[field]) for m, h in zip(pa["miss"], pa["hit"]))]
              for key, field in (("engine", "engine_decode_tok_s"), ("client", "decode_tok_s"))}
    last = pa["hit"][-1] if pa["hit"] else {}
    pa_summary = {k: v for k, v in pa.items() if k not in ("miss", "hit")}
    pa_summary["cached"] = f"{last.get('cached_tokens')}/{last.get('num_input_tokens')}"
    return {"bench": report["summary"], "perf_analyzer": pa_summary,
            "pooled": {key: ratio(p).as_dict() for key, p in pooled.items()}}


def summary_table(results: dict) -> str:
    """One row per storage and source: medians (min-max) per kind, and each hit/miss ratio with its interval."""
    rows = []
    for name, r in results.items():
        row, pa = r["bench"][1], r["perf_analyzer"]
        m, h = row["miss"], row["hit"]
        rows.append([name, "bench c=1", f"{m['ttft_ms'][0]:.1f}", f"{h['ttft_ms'][0]:.1f}",
                     range_cell(m["decode_tok_s"]), range_cell(h["decode_tok_s"]),
                     *(str(Ratio.of(row[k])) for k in ("engine_decode", "client_decode", "engine_cpu", "ttft")),
                     f"{int(h['cached'])}/{int(h['prompt_tokens'])}", f"{h['lookahead_steps']:.0f}",
                     f"{m['contiguity']:.2f}/{h['contiguity']:.2f}"])
        rows.append([name, "perf_analyzer", f"{pa['miss_ttft_ms'][0]:.1f}", f"{pa['hit_ttft_ms'][0]:.1f}",
                     range_cell(pa["miss_decode_tok_s"]), range_cell(pa["hit_decode_tok_s"]),
                     *(str(Ratio.of(pa[k])) for k in ("engine_decode", "client_decode", "engine_cpu", "ttft")),
                     pa["cached"], "", ""])
    header = ["storage", "source", "TTFT miss ms", "TTFT hit ms", "client decode miss tok/s",
              "client decode hit tok/s", "engine decode h/m", "client decode h/m", "engine CPU/tok h/m",
              "TTFT h/m", "cached", "la/req", "contig m/h"]
    return table(header, rows, left=2)


def verdicts(results: dict, tolerance: float) -> dict[str, dict]:
    out = {}
    for name, r in results.items():
        engine, client = Ratio.of(r["pooled"]["engine"]), Ratio.of(r["pooled"]["client"])
        out[name] = {"engine": call(engine, tolerance), "client": call(client, 2 * tolerance),
                     "line": verdict(name, engine, client, tolerance)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded small model)")
    ap.add_argument("--preset", default=None, help="a preset made and cached on first use, e.g. qwen2.5-0.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--storages", default="paged,dense", help="comma-separated, of: " + ", ".join(STORAGES))
    ap.add_argument("--prompt-tokens", type=int, default=471)
    ap.add_argument("--max-tokens", type=int, default=192)
    bench.stopping_flags(ap, pairs=400, settle=0.015, min_pairs=16, deadline=120)     # the bench's, per level
    ap.add_argument("--perf-pairs", type=int, default=16, help="perf_analyzer's interleaved pairs")
    ap.add_argument("--warmup", type=int, default=1, help="pairs each source runs first and leaves out")
    ap.add_argument("--concurrency", default="1", help="bench levels for paged storage (dense runs at 1)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help="hit/miss equal when the engine's interval is within 1 +- this (the client's: twice it)")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads in the server: 1 leaves a core "
                                                                 "to the client and Triton on a 2-core machine")
    ap.add_argument("--out", default=str(ROOT / "perf/results"))
    args = ap.parse_args(argv)
    storages = args.storages.split(",")
    if unknown := set(storages) - set(STORAGES):
        ap.error(f"--storages: unknown {', '.join(sorted(unknown))} (known: {', '.join(STORAGES)})")
    if args.preset:
        from engine.models.presets import cached_model
        args.model = str(cached_model(args.preset))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = {name: one_storage(name, args, out) for name in storages}
    text = summary_table(results)
    calls = verdicts(results, args.tolerance)
    lines = "\n".join(v["line"] for v in calls.values())
    print(f"\n== summary: prompt {args.prompt_tokens} tokens (HIT shares all but 23), {args.max_tokens} new tokens, "
          f"greedy; bench alternate pairs (until settled), perf_analyzer {args.perf_pairs} interleaved pairs, each "
          f"after {args.warmup} warm-up pair; medians (min-max); hit/miss: per-pair ratios' trimmed mean (95% CI)"
          f"\n{text}\n"
          f"\n== verdict (concurrency-1 pairs of both sources; engine: the engine's own first-to-last token timing)"
          f"\n{lines}")
    print(f"\nwall time {time.monotonic() - started:.0f}s; JSON and plots in {out}")
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "results": results, "verdicts": calls},
                                                 indent=2))
    (out / "summary.txt").write_text(f"{text}\n\n{lines}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
