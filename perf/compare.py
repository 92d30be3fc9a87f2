"""Read perf_analyzer profile exports of a MISS run and a HIT run; print TTFT and decode tok/s per request
(from response_timestamps) with medians and hit/miss ratios, and write a PNG.

    python -m perf.compare --miss perf/results/pa_miss.json --hit perf/results/pa_hit.json [--plot out.png]
TTFT = first token's response timestamp - request timestamp; decode = (tokens - 1) / (last - first token).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from perf.common import decode_rate, plot_requests, range_cell, spread
from perf.common import table as text_table


def _count(ids) -> int:
    if ids is None:
        return 1            # an export without output_ids: one token per response
    return len(ids) if isinstance(ids, list) else 1


def per_request(export: dict) -> list[dict]:
    rows = []
    for exp in export["experiments"]:
        for req in exp["requests"]:
            times = []
            for ts, out in zip(req["response_timestamps"], req.get("response_outputs") or [{}] * 10**6):
                times += [ts] * _count(out.get("output_ids") if out else None)
            if len(times) < 2:
                continue
            outs = req.get("response_outputs") or [{}]
            rows.append({"ttft_ms": (times[0] - req["timestamp"]) / 1e6,
                         "decode_tok_s": decode_rate([(t - times[0]) / 1e9 for t in times]),
                         "tokens": len(times),
                         "cached_tokens": outs[-1].get("cached_tokens"),
                         "num_input_tokens": outs[-1].get("num_input_tokens")})
    return rows


def compare(miss: dict | list[dict], hit: dict | list[dict]) -> dict:
    """Exports of one kind may come as a list (several alternating rounds); their requests are pooled."""
    m = [r for e in (miss if isinstance(miss, list) else [miss]) for r in per_request(e)]
    h = [r for e in (hit if isinstance(hit, list) else [hit]) for r in per_request(e)]
    out = {"miss": m, "hit": h}
    for name, rows in (("miss", m), ("hit", h)):
        out[f"{name}_ttft_ms"] = spread([r["ttft_ms"] for r in rows])
        out[f"{name}_decode_tok_s"] = spread([r["decode_tok_s"] for r in rows])
    out["decode_ratio"] = out["hit_decode_tok_s"][0] / out["miss_decode_tok_s"][0]
    out["ttft_ratio"] = out["hit_ttft_ms"][0] / out["miss_ttft_ms"][0]
    return out


def table(c: dict) -> str:
    rows = []
    for kind in ("miss", "hit"):
        last = c[kind][-1]
        cached = "-" if last["cached_tokens"] is None else f"{last['cached_tokens']}/{last['num_input_tokens']}"
        rows.append([kind, len(c[kind]), range_cell(c[f"{kind}_ttft_ms"]), range_cell(c[f"{kind}_decode_tok_s"]),
                     cached])
    header = ["kind", "n", "TTFT ms med (min-max)", "decode tok/s med (min-max)", "cached"]
    return text_table(header, rows) + f"\nhit/miss: decode {c['decode_ratio']:.3f}  TTFT {c['ttft_ratio']:.3f}"


def plot(c: dict, path: str) -> None:
    plot_requests({kind: [(i, r["decode_tok_s"], r["ttft_ms"]) for i, r in enumerate(c[kind])]
                   for kind in ("miss", "hit")}, path, "perf_analyzer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--miss", required=True, nargs="+", help="one or more exports of MISS runs")
    ap.add_argument("--hit", required=True, nargs="+", help="one or more exports of HIT runs")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    c = compare([json.loads(Path(f).read_text()) for f in args.miss],
                [json.loads(Path(f).read_text()) for f in args.hit])
    print(table(c))
    if args.plot:
        plot(c, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(c, indent=2))


if __name__ == "__main__":
    main()
