"""Decode tok/s and TTFT of one streamed request through tritonserver (gRPC) next to the engine in process,
same model, same prompts (cold: each prompt starts with a fresh nonce), medians over --repeats.

    python perf/bench_triton.py [--model DIR] [--max-tokens 128] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.stream import stream_grpc             # noqa: E402
from engine.config import EngineConfig            # noqa: E402
from engine.engine import Engine                  # noqa: E402
from perf.inprocess import greedy_run             # noqa: E402
from scripts.tritonserver import launch           # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads, server and in-process alike")
    args = ap.parse_args()
    base = (ROOT / "engine/models/corpus.txt").read_text(encoding="utf-8")[:1500]
    prompts = [f"request {i}: {base}" for i in range(2 * args.repeats + 2)]
    env = {"PAGODA_MODEL": args.model} if args.model else {}
    env["PAGODA_NUM_THREADS"] = str(args.num_threads)
    log = Path(tempfile.mkdtemp(prefix="pagoda-bench-")) / "tritonserver.log"
    t0 = time.monotonic()
    server = launch(env, log)
    startup = time.monotonic() - t0
    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    triton = []
    try:
        stream_grpc(server.grpc_url, "llm", prompts[0], params)                    # warm-up
        for p in prompts[2:2 + args.repeats]:
            r = stream_grpc(server.grpc_url, "llm", p, params)
            triton.append((r.ttft, r.decode_rate))
    finally:
        server.stop()
    engine = Engine(EngineConfig(model=args.model, num_threads=args.num_threads))
    greedy_run(engine, prompts[1], args.max_tokens)                                  # warm-up
    local = [greedy_run(engine, p, args.max_tokens) for p in prompts[2 + args.repeats:]]
    print(f"tritonserver startup to ready: {startup:.1f}s; {args.repeats} cold requests each, "
          f"{args.max_tokens} new tokens, medians (min-max)")
    for name, rows in (("triton grpc", triton), ("in-process", local)):
        ttft = [r[0] * 1000 for r in rows]
        rate = [r[1] for r in rows]
        print(f"{name:12} ttft {statistics.median(ttft):7.1f}ms ({min(ttft):.1f}-{max(ttft):.1f})  "
              f"decode {statistics.median(rate):7.1f} tok/s ({min(rate):.1f}-{max(rate):.1f})")
    ratio = statistics.median(r[1] for r in triton) / statistics.median(r[1] for r in local)
    print(f"decode triton / in-process: {ratio:.2f}")


if __name__ == "__main__":
    main()
