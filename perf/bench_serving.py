"""Serving benchmark: TTFT and decode tok/s after a prompt-cache miss vs after a hit, at several concurrencies.

    python -m perf.bench_serving --url 127.0.0.1:8001 --protocol triton --concurrency 1,2,4 \\
        --prompt-tokens 512 --max-tokens 512 --mode alternate --pairs 7 --json out.json --plot out.png
alternate: one discarded warm-up pair, then MISS/HIT pairs of identical geometry (greedy, EOS ignored, so both
decode the same window). decode tok/s = (tokens - 1) / (t_last_token - t_first_token), from arrival times.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from client.metrics import scrape_many
from client.stream import Result, stream_grpc, stream_openai
from client.workload import Workload
from perf.common import plot_requests, range_cell, spread
from perf.common import table as text_table
from perf.verdict import Ratio, ratio

# hit/miss ratios, each the median of per-pair ratios with its 95% interval: name -> the Sample field
PAIRED = {"client_decode": "decode_tok_s", "engine_decode": "engine_decode_tok_s", "engine_cpu": "engine_cpu_ms",
          "ttft": "ttft_s"}
COUNTERS = ("pagoda_decode_lookahead_steps_total", "pagoda_decode_cpu_seconds_total",
            "pagoda_block_table_pairs_total", "pagoda_block_table_consecutive_pairs_total")


@dataclass(slots=True)
class Sample:
    concurrency: int
    pair: int
    kind: str                 # miss | hit
    ttft_s: float
    decode_tok_s: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    lookahead_steps: float    # per request: the counter's delta over the group / group size
    decode_cpu_ms: float = float("nan")   # engine-thread CPU per decoded token, over the group
    contiguity: float = float("nan")      # consecutive fraction of the group's block tables (paged)
    error: str | None = None
    engine_decode_tok_s: float = float("nan")    # the engine's own decode rate of this request
    engine_cpu_ms: float = float("nan")          # and its engine-thread CPU per decoded token


def counters(metrics_url: str | None) -> list[float]:
    """The server's COUNTERS; NaN without a metrics endpoint."""
    return scrape_many(metrics_url, *COUNTERS) if metrics_url else [float("nan")] * len(COUNTERS)


def pairs(samples: list[Sample], concurrency: int, field: str) -> list[tuple[float, float]]:
    """Per pair, (miss, hit) of one Sample field, each side's mean over the pair's group."""
    out = []
    for pair in sorted({s.pair for s in samples if s.concurrency == concurrency}):
        group = {k: [getattr(s, field) for s in samples if s.concurrency == concurrency and s.pair == pair
                     and s.kind == k and s.error is None] for k in ("miss", "hit")}
        if group["miss"] and group["hit"]:
            out.append((statistics.mean(group["miss"]), statistics.mean(group["hit"])))
    return out


def summarize(samples: list[Sample]) -> dict:
    """Per concurrency: median/min/max of TTFT and decode rate for miss and hit, and the hit/miss ratios."""
    out = {}
    for c in sorted({s.concurrency for s in samples}):
        row = {}
        for kind in ("miss", "hit"):
            group = [s for s in samples if s.concurrency == c and s.kind == kind and s.error is None]
            if not group:
                continue
            row[kind] = {"n": len(group),
                         "ttft_ms": spread([1000 * s.ttft_s for s in group]),
                         "decode_tok_s": spread([s.decode_tok_s for s in group]),
                         "engine_decode_tok_s": spread([s.engine_decode_tok_s for s in group]),
                         "engine_cpu_ms": spread([s.engine_cpu_ms for s in group]),
                         "cached": statistics.median(s.cached_tokens for s in group),
                         "prompt_tokens": statistics.median(s.prompt_tokens for s in group),
                         "lookahead_steps": statistics.median(s.lookahead_steps for s in group),
                         "decode_cpu_ms": statistics.median(s.decode_cpu_ms for s in group),
                         "contiguity": statistics.median(s.contiguity for s in group)}
        if "miss" in row and "hit" in row:
            for name, field in PAIRED.items():
                row[name] = ratio(pairs(samples, c, field)).as_dict()
        out[c] = row
    return out


def table(summary: dict, title: str = "") -> str:
    rows, notes = [], []
    for c, row in summary.items():
        for kind in ("miss", "hit"):
            if kind in row:
                r = row[kind]
                rows.append([c, kind, r["n"], range_cell(r["ttft_ms"]), range_cell(r["decode_tok_s"]),
                             range_cell(r["engine_decode_tok_s"]), range_cell(r["engine_cpu_ms"], 3),
                             f"{int(r['cached'])}/{int(r['prompt_tokens'])}", f"{r['lookahead_steps']:.0f}",
                             f"{r['contiguity']:.3f}"])
        if "engine_decode" in row:
            notes.append(f"{c:>4} hit/miss, trimmed mean of per-pair ratios (95% CI): " + "  ".join(
                f"{label} {Ratio.of(row[name])}" for name, label in (
                    ("engine_decode", "engine decode"), ("client_decode", "client decode"),
                    ("engine_cpu", "engine CPU/token"), ("ttft", "TTFT"))))
    header = ["conc", "kind", "n", "TTFT ms med (min-max)", "client decode tok/s", "engine decode tok/s",
              "engine cpu ms/tok", "cached", "lookahead/req", "contiguity"]
    return "\n".join([title] * bool(title) + [text_table(header, rows, left=0)] + notes)


def plot(samples: list[Sample], path: str) -> None:
    series = {f"c={c} {kind}": [(s.pair, s.decode_tok_s, 1000 * s.ttft_s) for s in samples
                                if s.concurrency == c and s.kind == kind and s.error is None]
              for c in sorted({s.concurrency for s in samples}) for kind in ("miss", "hit")}
    plot_requests(series, path, "per pair")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stream = stream_grpc if args.protocol == "triton" else stream_openai
        host = args.url.rsplit(":", 1)[0]
        self.metrics_url = args.metrics_url or (f"http://{host}:8002/metrics" if args.protocol == "triton"
                                                else f"http://{args.url}/metrics")
        self.params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}

    def group(self, prompts: list[list[int]]) -> tuple[list[Result], float, float, float]:
        """Run prompts concurrently; returns the results, the lookahead counter's delta per request, the engine's
        decode CPU per decoded token (ms) and the block-table contiguity of the group."""
        before = counters(self.metrics_url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: self.stream(self.args.url, self.args.model, p, self.params), prompts))
        # no wait: a FINAL response leaves the Triton model after its request's counters are mirrored
        steps, cpu, pairs, consecutive = (a - b for a, b in zip(counters(self.metrics_url), before))
        decoded = sum(max(0, len(r.ids) - 1) for r in results)
        return (results, steps / len(prompts), 1000 * cpu / max(1, decoded),
                consecutive / pairs if pairs else float("nan"))

    def settled(self, samples: list[Sample], concurrency: int, started: float) -> bool:
        """--settle: the engine's hit/miss interval is that narrow (after --min-pairs); --deadline: time is up."""
        a = self.args
        if a.deadline and time.monotonic() - started > a.deadline:
            return True
        if not a.settle:
            return False            # no interval to work out (a bootstrap, ~50 ms at 150 pairs)
        r = ratio(pairs(samples, concurrency, "engine_decode_tok_s"))
        return r.n >= a.min_pairs and r.half_width <= a.settle

    def run(self, concurrency: int, workload: Workload, progress) -> list[Sample]:
        a, out, started = self.args, [], time.monotonic()
        for pair in range(a.warmup + a.pairs):
            if pair > a.warmup and a.mode == "alternate" and self.settled(out, concurrency, started):
                break
            kinds = ["miss", "hit"] if a.mode == "alternate" else [a.mode]
            misses = [workload.miss() for _ in range(concurrency)]
            for kind in kinds:
                if kind == "hit" and a.mode == "hit":
                    self.group(misses)             # prime the prefix; not a sample
                prompts = misses if kind == "miss" else [workload.hit(m) for m in misses]
                results, steps, cpu, contiguity = self.group(prompts)
                if pair >= a.warmup:
                    out += [Sample(concurrency, pair - a.warmup, kind, r.ttft, r.decode_rate, len(r.ids), len(p),
                                   r.cached_tokens, steps, cpu, contiguity, r.error, r.engine_decode_tok_s,
                                   r.engine_decode_cpu_ms) for r, p in zip(results, prompts)]
                progress.update(len(prompts))
                time.sleep(a.cooldown)
        return out


def stopping_flags(ap: argparse.ArgumentParser, pairs: int, settle: float, min_pairs: int, deadline: float) -> None:
    """How many alternate pairs a level runs: --pairs at most, fewer once settled or past the deadline."""
    ap.add_argument("--pairs", type=int, default=pairs, help="pairs per level (the most, with --settle or --deadline)")
    ap.add_argument("--settle", type=float, default=settle, help="alternate: stop a level once the engine's "
                    "hit/miss interval's half width is at most this fraction (0: run every pair)")
    ap.add_argument("--min-pairs", type=int, default=min_pairs, help="--settle: pairs before it may stop")
    ap.add_argument("--deadline", type=float, default=deadline, help="seconds per level after which no pair "
                    "starts (0: none)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001", help="triton: gRPC host:port; openai: HTTP host:port")
    ap.add_argument("--protocol", choices=["triton", "openai"], default="triton")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--metrics-url", default=None)
    ap.add_argument("--concurrency", default="1", help="comma-separated, e.g. 1,2,4")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--hit-suffix", type=int, default=23, help="tokens a HIT prompt does not share")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--mode", choices=["alternate", "hit", "miss"], default="alternate")
    stopping_flags(ap, pairs=7, settle=0.0, min_pairs=12, deadline=0.0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cooldown", type=float, default=0.0, help="seconds between groups")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--vocab-high", type=int, default=900, help="prompt token ids are drawn from [3, this)")
    ap.add_argument("--first-tokens", default="3:450", help="LO:HI, the range of MISS prompts' first tokens "
                    "(disjoint from other workloads' on the same server)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--title", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    bench = Bench(args)
    workload = Workload(args.prompt_tokens, args.hit_suffix, args.seed, high=args.vocab_high,
                        first=range(*map(int, args.first_tokens.split(":"))))
    per_group = 3 if args.mode == "hit" else (2 if args.mode == "alternate" else 1)
    total = sum(c * per_group * (args.warmup + args.pairs) for c in levels) - (
        sum(levels) * (args.warmup + args.pairs) if args.mode == "hit" else 0)
    samples: list[Sample] = []
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr) as progress:
        for c in levels:
            samples += bench.run(c, workload, progress)
    summary = summarize(samples)
    print(table(summary, args.title))
    errors = [s.error for s in samples if s.error]
    if errors:
        print(f"{len(errors)} requests failed, first: {errors[0]}", file=sys.stderr)
    report = {"config": vars(args), "summary": summary, "samples": [asdict(s) for s in samples]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(samples, args.plot)
    return report


if __name__ == "__main__":
    main()
