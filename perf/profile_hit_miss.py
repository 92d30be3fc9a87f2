"""In process, no server or client: per decode tick, where the time goes after a prompt-cache miss vs a hit.

    python -m perf.profile_hit_miss [--storage paged|dense] [--pairs 12] [--max-tokens 96] [--threads 1]
        [--preset qwen2.5-0.5b --dtype bfloat16 --device cuda] [--json OUT]
For each alternating MISS/HIT pair it records every decode tick's wall time, the engine thread's CPU time (which
excludes time the VM or other processes took from it), and the time inside the torch runner's KV ops that ran:
the KV write and the attention op when they are separate calls (reference ops, Triton kernels), their fused call
(the CPU decode kernel), or dense attention. Then it prints medians per kind: if the two paths did different work
per step, it shows here, free of the serving stack's noise. An op that never ran gets no column. On CUDA the op
columns are launch times (the tick waits for the step).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from client.workload import Workload
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sampling import SamplingParams
from engine.kernels import reference
from perf.common import table
from perf.verdict import ratio

SPENT: Counter[str] = Counter()          # seconds inside each op during the current tick


def timed(column: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        SPENT[column] += time.perf_counter() - t
        return out
    return wrapper


def instrument(engine: Engine) -> None:
    """Time the ops this engine's runner calls: its KernelOps (paged) or the dense attention."""
    runner = engine.runner
    ops = getattr(runner, "ops", None)
    if ops is None:
        return                                          # the MLX runner: no op columns
    if runner.paged:
        runner.ops = dataclasses.replace(
            ops, write_kv=timed("kv write", ops.write_kv),
            paged_decode_attention=timed("attention", ops.paged_decode_attention),
            decode_step=ops.decode_step and timed("kv write+attention", ops.decode_step))
    else:
        reference.causal_attention = timed("attention", reference.causal_attention)


def decode_ticks(engine: Engine, prompt: list[int], params: SamplingParams) -> dict[str, float]:
    """Median per-tick times (ms) over the request's decode ticks."""
    engine.on_delta = lambda d: None
    req = engine.add(engine.make_request(prompt, params))
    while not req.output_ids:                      # prefill
        engine.step()
    ticks: dict[str, list[float]] = {"tick": [], "cpu": []}
    while engine.has_work:
        SPENT.clear()
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        ticks["tick"].append(time.perf_counter() - t)
        ticks["cpu"].append(time.thread_time() - c)
        for column, seconds in SPENT.items():
            ticks.setdefault(column, []).append(seconds)
    return {k: 1000 * statistics.median(v) for k, v in ticks.items()} | {"cached": req.num_cached}


def main(argv: list[str] | None = None) -> dict:
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
    ap.add_argument("--attention", default="auto", choices=["auto", "triton", "reference", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.preset:
        from engine.models.presets import cached_model
        args.model = str(cached_model(args.preset))
    engine = Engine(EngineConfig(model=args.model, kv_storage=args.storage, num_threads=args.threads,
                                 max_batch_size=4 if args.storage == "paged" else 1, dtype=args.dtype,
                                 device=args.device, attention=args.attention))
    instrument(engine)
    w = Workload(args.prompt_tokens, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows: dict[str, list[dict]] = {"miss": [], "hit": []}
    for pair in range(args.pairs + 1):
        miss = w.miss()
        m, h = decode_ticks(engine, miss, params), decode_ticks(engine, w.hit(miss), params)
        if pair:                                   # the first pair warms up
            rows["miss"].append(m)
            rows["hit"].append(h)
    ran = {c for r in rows["miss"] + rows["hit"] for c in r}            # ops that ran in some decode tick
    columns = ["tick", "cpu", *sorted(ran - {"tick", "cpu", "cached"})]
    ops = getattr(engine.runner, "ops", None)
    path = "no op columns (MLX)" if ops is None else f"attention {ops.name}" if engine.runner.paged else "dense"
    print(f"{args.storage} on {getattr(engine.runner, 'device', 'cpu')}, {path}: "
          f"{args.pairs} pairs, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens; "
          f"medians over pairs of per-request median decode tick (ms)")
    summary: dict = {"args": vars(args)}
    for kind, rs in rows.items():
        summary[kind] = {k: statistics.median(r[k] for r in rs if k in r) for k in [*columns, "cached"]}
    print(table(["kind", *columns, "cached"],
                [[kind, *(f"{summary[kind][c]:.3f}" for c in columns), f"{summary[kind]['cached']:.0f}"]
                 for kind in rows]))
    for key in [*columns]:
        r = ratio([(m[key], h[key]) for m, h in zip(rows["miss"], rows["hit"]) if key in m and key in h])
        summary[f"{key}_ratio"] = r.as_dict()
        print(f"hit/miss {key} time per tick, per-pair ratios' trimmed mean (95% CI): {r}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
