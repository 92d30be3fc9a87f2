"""What a decode step costs as its rows grow: R sequences decoded together (a batch of R, or the rows of a
speculative verify step), the step's milliseconds per row count, and each against the one-row step. It is the
price a draft token pays, so it bounds what n-gram speculation can win at a given concurrency.

    python -m perf.bench_rows [--model FILE|DIR] [--rows 1 2 4 8 12 16] [--repeats 3] [--tokens 48] [--threads 2]

The model defaults to the registry's Gemma 3 270M (GGUF). The row counts are interleaved within each repeat; the
table gives each count's median milliseconds a step with the repeats' range."""
from __future__ import annotations

import argparse
import statistics
import time

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sampling import SamplingParams
from perf.common import cpu_model, prompt_ids, table


def step_ms(engine: Engine, rows: int, tokens: int) -> float:
    """Milliseconds a decode step with `rows` sequences, once every sequence is past its prefill."""
    reqs = [engine.make_request(prompt_ids(64, seed=100 + i), SamplingParams(max_tokens=tokens, temperature=0,
                                                                             ignore_eos=True)) for i in range(rows)]
    for r in reqs:
        engine.add(r)
    while not all(len(r.output_ids) >= 2 for r in reqs):
        engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1000


def main(argv: list[str] | None = None) -> dict[int, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.model is None:
        from perf.bench_spec import default_model
        args.model = default_model()
    engine = Engine(EngineConfig(model=args.model, num_threads=args.threads, max_batch_size=max(args.rows)),
                    on_delta=lambda d: None)
    step_ms(engine, 1, 8)                                                   # warm-up
    times: dict[int, list[float]] = {r: [] for r in args.rows}
    for _ in range(args.repeats):
        for r in args.rows:
            times[r].append(step_ms(engine, r, args.tokens))
    one = statistics.median(times[min(args.rows)])
    print(f"{args.model}: {args.threads} threads, {cpu_model()}, {args.repeats} repeats of {args.tokens} tokens")
    print(table(["rows", "ms a step (range)", "x the fewest rows' step"],
                [[r, f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})", f"{statistics.median(t) / one:.2f}"]
                 for r, t in times.items()]))
    return times


if __name__ == "__main__":
    main()
