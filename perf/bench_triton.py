"""Decode tok/s and TTFT of one streamed request through tritonserver (gRPC) next to the engine in process, same
model, same prompts (cold: each prompt starts with a fresh nonce). With `--engine-process both` (the default) two
servers run, the engine in a child process (config.pbtxt's default) and on a thread of the Python-backend stub;
every repeat runs each server and then the engine in process, so each served/in-process ratio pairs neighbours.

    python -m perf.bench_triton [--model DIR] [--max-tokens 128] [--repeats 5] [--num-threads 1]
                                [--engine-process both|true|false]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from client.stream import stream_grpc
from engine.config import EngineConfig
from engine.core.engine import Engine
from perf.common import ROOT, greedy_run, ratio_of_pairs
from scripts.tritonserver import launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads, server and in-process alike")
    ap.add_argument("--engine-process", choices=["both", "true", "false"], default="both")
    args = ap.parse_args()
    base = (ROOT / "engine/models/corpus.txt").read_text(encoding="utf-8")[:1500]
    prompts = [f"request {i}: {base}" for i in range(args.repeats + 1)]
    modes = ["true", "false"] if args.engine_process == "both" else [args.engine_process]
    env = {"PAGODA_NUM_THREADS": str(args.num_threads), **({"PAGODA_MODEL": args.model} if args.model else {})}
    logs = Path(tempfile.mkdtemp(prefix="pagoda-bench-"))
    servers, startup = {}, {}
    try:
        for mode in modes:
            t0 = time.monotonic()
            servers[mode] = launch({**env, "PAGODA_ENGINE_PROCESS": mode}, logs / f"tritonserver-{mode}.log")
            startup[mode] = time.monotonic() - t0
        engine = Engine(EngineConfig(model=args.model, num_threads=args.num_threads))
        params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        greedy_run(engine, prompts[0], args.max_tokens)                                       # warm-up
        for server in servers.values():
            stream_grpc(server.grpc_url, "llm", prompts[0], params)
        rows: dict[str, list[tuple[float, float]]] = {m: [] for m in [*modes, "in-process"]}
        for p in prompts[1:]:
            for mode, server in servers.items():
                r = stream_grpc(server.grpc_url, "llm", p, params)
                rows[mode].append((r.ttft, r.decode_rate))
            rows["in-process"].append(greedy_run(engine, p, args.max_tokens))
    finally:
        for server in servers.values():
            server.stop()
    print(f"startup to ready: {', '.join(f'engine_process={m} {s:.1f}s' for m, s in startup.items())}; "
          f"{args.repeats} cold requests each, {args.max_tokens} new tokens, medians (min-max)")
    local = [rate for _, rate in rows["in-process"]]
    for name, got in rows.items():
        ttft = [t * 1000 for t, _ in got]
        rate = [r for _, r in got]
        label = name if name == "in-process" else f"triton grpc, engine_process={name}"
        ratio = "" if name == "in-process" else \
            f"  served/in-process {ratio_of_pairs(rate, local):.2f} (per-pair median)"
        print(f"{label:36} ttft {statistics.median(ttft):7.1f}ms ({min(ttft):.1f}-{max(ttft):.1f})  "
              f"decode {statistics.median(rate):7.1f} tok/s ({min(rate):.1f}-{max(rate):.1f}){ratio}")


if __name__ == "__main__":
    main()
