"""Read perf_analyzer profile exports of a MISS run and a HIT run; print TTFT and decode tok/s per request
(from response_timestamps) with medians and hit/miss ratios, and write a PNG.

    python perf/compare.py --miss perf/results/pa_miss.json --hit perf/results/pa_hit.json [--plot out.png]
TTFT = first token's response timestamp - request timestamp; decode = (tokens - 1) / (last - first token).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


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
                         "decode_tok_s": (len(times) - 1) / ((times[-1] - times[0]) / 1e9),
                         "tokens": len(times),
                         "cached_tokens": outs[-1].get("cached_tokens"),
                         "num_input_tokens": outs[-1].get("num_input_tokens")})
    return rows


def stats(rows: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in rows]
    return statistics.median(values), min(values), max(values)


def compare(miss: dict | list[dict], hit: dict | list[dict]) -> dict:
    """Exports of one kind may come as a list (several alternating rounds); their requests are pooled."""
    m = [r for e in (miss if isinstance(miss, list) else [miss]) for r in per_request(e)]
    h = [r for e in (hit if isinstance(hit, list) else [hit]) for r in per_request(e)]
    out = {"miss": m, "hit": h}
    for name, rows in (("miss", m), ("hit", h)):
        out[f"{name}_ttft_ms"] = stats(rows, "ttft_ms")
        out[f"{name}_decode_tok_s"] = stats(rows, "decode_tok_s")
    out["decode_ratio"] = out["hit_decode_tok_s"][0] / out["miss_decode_tok_s"][0]
    out["ttft_ratio"] = out["hit_ttft_ms"][0] / out["miss_ttft_ms"][0]
    return out


def table(c: dict) -> str:
    lines = [f"{'kind':4} {'n':>3} {'TTFT ms med (min-max)':>24} {'decode tok/s med (min-max)':>28} {'cached':>9}"]
    for kind in ("miss", "hit"):
        t, d, rows = c[f"{kind}_ttft_ms"], c[f"{kind}_decode_tok_s"], c[kind]
        cached = rows[-1]["cached_tokens"]
        cached = f"{cached}/{rows[-1]['num_input_tokens']}" if cached is not None else "-"
        lines.append(f"{kind:4} {len(rows):>3} {t[0]:9.1f} ({t[1]:6.1f}-{t[2]:6.1f}) {d[0]:11.1f} ({d[1]:6.1f}-{d[2]:6.1f})"
                     f" {cached:>9}")
    lines.append(f"hit/miss: decode {c['decode_ratio']:.3f}  TTFT {c['ttft_ratio']:.3f}")
    return "\n".join(lines)


def plot(c: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, marker in (("miss", "o"), ("hit", "^")):
        rows = c[kind]
        axes[0].plot(range(len(rows)), [r["decode_tok_s"] for r in rows], marker, label=kind)
        axes[1].plot(range(len(rows)), [r["ttft_ms"] for r in rows], marker, label=kind)
    axes[0].set(title="perf_analyzer: decode tok/s per request", xlabel="request", ylabel="tok/s")
    axes[1].set(title="perf_analyzer: TTFT per request", xlabel="request", ylabel="ms", yscale="log")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--miss", required=True, nargs="+", help="one or more exports of MISS runs")
    ap.add_argument("--hit", required=True, nargs="+", help="one or more exports of HIT runs")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    c = compare([json.loads(Path(f).read_text()) for f in args.miss], [json.loads(Path(f).read_text()) for f in args.hit])
    print(table(c))
    if args.plot:
        plot(c, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(c, indent=2))


if __name__ == "__main__":
    main()
