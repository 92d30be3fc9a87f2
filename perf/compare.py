"""Read perf_analyzer profile exports of an interleaved hit/miss run: per request, TTFT and decode tok/s (from
response_timestamps) and the engine's own decode timing (the decode_tok_s / decode_cpu_ms outputs); pair each MISS
with the HIT that followed it; print medians and the paired hit/miss ratios with their 95% intervals; write a PNG.

    python -m perf.compare perf/results/pa_run.json [...] [--plot out.png] [--json out.json]
TTFT = first token's response timestamp - request timestamp; decode = (tokens - 1) / (last - first token).
A request is a HIT when the server reports at least a quarter of its prompt cached (return_cached_tokens),
else a MISS.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from perf.common import decode_rate, plot_requests, range_cell, spread
from perf.common import table as text_table
from perf.verdict import Ratio, ratio

PAIRED = {"client_decode": "decode_tok_s", "engine_decode": "engine_decode_tok_s", "engine_cpu": "engine_cpu_ms",
          "ttft": "ttft_ms"}


def _count(ids) -> int:
    if ids is None:
        return 1            # an export without output_ids: one token per response
    return len(ids) if isinstance(ids, list) else 1


def _number(value) -> float:
    """A timing output's value from the export (a scalar, a one-element list, or absent) as a float; NaN when absent
    or 0 (the engine's "not ended")."""
    if isinstance(value, list):
        value = value[0] if value else None
    try:
        return float(value) or float("nan")
    except (TypeError, ValueError):
        return float("nan")


def per_request(export: dict) -> list[dict]:
    rows = []
    for exp in export["experiments"]:
        for req in exp["requests"]:
            times = []
            outs = req.get("response_outputs") or [{}] * len(req["response_timestamps"])
            for ts, out in zip(req["response_timestamps"], outs):
                times += [ts] * _count(out.get("output_ids") if out else None)
            if len(times) < 2:
                continue
            last = outs[-1] or {}           # the FINAL response: the engine's timing rides on it
            rows.append({"timestamp": req["timestamp"],
                         "ttft_ms": (times[0] - req["timestamp"]) / 1e6,
                         "decode_tok_s": decode_rate([(t - times[0]) / 1e9 for t in times]),
                         "engine_decode_tok_s": _number(last.get("decode_tok_s")),
                         "engine_cpu_ms": _number(last.get("decode_cpu_ms")),
                         "tokens": len(times),
                         "cached_tokens": last.get("cached_tokens"),
                         "num_input_tokens": last.get("num_input_tokens")})
    return sorted(rows, key=lambda r: r["timestamp"])


def pair_up(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(MISS, HIT) for each MISS immediately followed by a HIT, in request order. A HIT is a request that adopted at
    least a quarter of its prompt: a MISS may adopt a first token on dense storage, whose prompt cache matches any
    prefix."""
    def hit(r: dict) -> bool:
        return 4 * (r["cached_tokens"] or 0) >= (r["num_input_tokens"] or 1)
    pairs, i = [], 0
    while i + 1 < len(rows):
        a, b = rows[i], rows[i + 1]
        if not hit(a) and hit(b):
            pairs.append((a, b))
            i += 2
        else:
            i += 1
    return pairs


def compare(exports: dict | list[dict], warmup: int = 0) -> dict:
    """Exports of interleaved runs (one or several) -> per-kind rows and spreads, and the paired ratios. The first
    `warmup` pairs are left out."""
    pairs = [p for e in (exports if isinstance(exports, list) else [exports])
             for p in pair_up(per_request(e))[warmup:]]
    out: dict = {"miss": [m for m, _ in pairs], "hit": [h for _, h in pairs]}
    for kind in ("miss", "hit"):
        for key in ("ttft_ms", "decode_tok_s", "engine_decode_tok_s", "engine_cpu_ms"):
            values = [r[key] for r in out[kind] if not math.isnan(r[key])]
            if values:
                out[f"{kind}_{key}"] = spread(values)
    for name, key in PAIRED.items():
        out[name] = ratio([(m[key], h[key]) for m, h in pairs]).as_dict()
    return out


def table(c: dict) -> str:
    rows = []
    for kind in ("miss", "hit"):
        if not c[kind]:
            continue
        last = c[kind][-1]
        cached = "-" if last["cached_tokens"] is None else f"{last['cached_tokens']}/{last['num_input_tokens']}"
        engine = [range_cell(c[f"{kind}_{k}"], d) if f"{kind}_{k}" in c else "-"
                  for k, d in (("engine_decode_tok_s", 1), ("engine_cpu_ms", 3))]
        rows.append([kind, len(c[kind]), range_cell(c[f"{kind}_ttft_ms"]), range_cell(c[f"{kind}_decode_tok_s"]),
                     *engine, cached])
    header = ["kind", "n", "TTFT ms med (min-max)", "client decode tok/s", "engine decode tok/s",
              "engine cpu ms/tok", "cached"]
    notes = "  ".join(f"{label} {Ratio.of(c[name])}" for name, label in (
        ("engine_decode", "engine decode"), ("client_decode", "client decode"), ("engine_cpu", "engine CPU/token"),
        ("ttft", "TTFT")))
    return text_table(header, rows) + f"\nhit/miss, trimmed mean of per-pair ratios (95% CI): {notes}"


def plot(c: dict, path: str) -> None:
    plot_requests({kind: [(i, r["decode_tok_s"], r["ttft_ms"]) for i, r in enumerate(c[kind])]
                   for kind in ("miss", "hit")}, path, "perf_analyzer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", help="perf_analyzer exports of interleaved MISS/HIT runs")
    ap.add_argument("--warmup", type=int, default=1, help="pairs left out at the start of each export")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    c = compare([json.loads(Path(f).read_text()) for f in args.exports], args.warmup)
    print(table(c))
    if args.plot:
        plot(c, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(c, indent=2))


if __name__ == "__main__":
    main()
