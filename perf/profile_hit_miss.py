"""In process, no server or client: per decode step, where the time goes after a prompt-cache miss vs a hit.

    python perf/profile_hit_miss.py [--storage paged|dense] [--pairs 12] [--max-tokens 96] [--threads 1]
        [--preset qwen2.5-0.5b --dtype bfloat16 --device cuda] [--json OUT]
For each alternating MISS/HIT pair it records every decode tick's wall time, the engine thread's CPU time (which
excludes time the VM or other processes took from it), and the time spent in the KV write and the attention op,
then prints medians per kind: if the two paths did different work per step, it shows here,
free of the serving stack's noise. On CUDA the op columns are launch times (the tick waits for the step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.workload import Workload            # noqa: E402
from engine.config import EngineConfig          # noqa: E402
from engine.core.engine import Engine                # noqa: E402
from engine.kernels import reference as ref     # noqa: E402
from engine.core.sampling import SamplingParams      # noqa: E402

SPENT = {"write_kv": 0.0, "paged_decode_attention": 0.0, "causal_attention": 0.0}


def timed(name: str):
    original = getattr(ref, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        SPENT[name] += time.perf_counter() - t
        return out
    setattr(ref, name, wrapper)


def decode_ticks(engine: Engine, prompt: list[int], params: SamplingParams) -> dict[str, float]:
    """Median per-tick times (ms) over the request's decode ticks."""
    req = engine.add(engine.make_request(prompt, params))
    while not req.output_ids:                      # prefill
        engine.step()
    ticks = {"tick": [], "cpu": [], "write": [], "attention": []}
    while engine.has_work:
        for k in SPENT:
            SPENT[k] = 0.0
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        ticks["tick"].append(time.perf_counter() - t)
        ticks["cpu"].append(time.thread_time() - c)
        ticks["write"].append(SPENT["write_kv"])
        ticks["attention"].append(SPENT["paged_decode_attention"] + SPENT["causal_attention"])
    return {k: 1000 * statistics.median(v) for k, v in ticks.items()} | {"cached": req.num_cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--storage", choices=["paged", "dense"], default="paged")
    ap.add_argument("--prompt-tokens", type=int, default=471)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--preset", default=None, help="a preset made and cached on first use, e.g. qwen2.5-0.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name in SPENT:
        timed(name)
    if args.preset:
        from engine.models.presets import cached_model
        args.model = str(cached_model(args.preset))
    engine = Engine(EngineConfig(model=args.model, kv_storage=args.storage, num_threads=args.threads,
                                 max_batch_size=4 if args.storage == "paged" else 1, dtype=args.dtype,
                                 device=args.device, attention=args.attention))
    w = Workload(args.prompt_tokens, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows: dict[str, list[dict]] = {"miss": [], "hit": []}
    for pair in range(args.pairs + 1):
        miss = w.miss()
        m, h = decode_ticks(engine, miss, params), decode_ticks(engine, w.hit(miss), params)
        if pair:                                   # the first pair warms up
            rows["miss"].append(m)
            rows["hit"].append(h)
    ops = getattr(engine.runner, "ops", None)
    print(f"{args.storage} on {getattr(engine.runner, 'device', 'cpu')}, attention {ops.name if ops else '-'}: "
          f"{args.pairs} pairs, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens; "
          f"medians over pairs of per-request median decode tick (ms)")
    summary: dict = {"args": vars(args)}
    for kind, rs in rows.items():
        med = summary[kind] = {k: statistics.median(r[k] for r in rs)
                               for k in ("tick", "cpu", "write", "attention", "cached")}
        print(f"{kind:4} tick {med['tick']:.3f}  thread cpu {med['cpu']:.3f}  kv write {med['write']:.3f}  "
              f"attention {med['attention']:.3f}  cached {med['cached']:.0f}")
    for key in ("tick", "cpu"):
        ratio = summary[f"{key}_ratio"] = statistics.median(h[key] / m[key] for m, h in zip(rows["miss"], rows["hit"]))
        print(f"hit/miss {key} time, median of pairs: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
