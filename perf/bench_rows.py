"""What a decode step costs as its rows grow: R sequences decoded together (a batch of R, or the rows of a
speculative verify step), the step's milliseconds per row count, and each against the one-row step. It is the
price a draft token pays, so it bounds what n-gram speculation can win at a given concurrency.

    python -m perf.bench_rows [--model FILE|DIR] [--rows 1 2 4 8 12 16] [--repeats 3] [--tokens 48] [--threads 2]
                              [--against COMMIT] [--dtype auto|bfloat16|float32]

The model defaults to the registry's Gemma 3 270M (GGUF). The row counts are interleaved within each repeat; the
table gives each count's median milliseconds a step with the repeats' range. `--against COMMIT`: a second engine
on the CPU kernels of that commit (its engine/kernels sources, built beside these), alternated with this one step
count by step count, and each count's ratio (the commit's step over this one's: above 1, faster here) with its
pairs' range."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sampling import SamplingParams
from engine.kernels import cpu_build
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


@contextlib.contextmanager
def kernels_at(commit: str):
    """Within it, the CPU kernels build from `commit`'s sources (an engine made then keeps that library); a header
    the commit does not have yet is left out (its sources do not include it)."""
    sources, headers = cpu_build.SOURCES, cpu_build.HEADERS
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                               cwd=sources[0].parent).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        def at(path: Path, needed: bool = True) -> Path | None:
            rel = path.relative_to(root).as_posix()
            out = Path(tmp) / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shown = subprocess.run(["git", "show", f"{commit}:{rel}"], capture_output=True, check=needed, cwd=root)
            if shown.returncode:
                return None
            out.write_bytes(shown.stdout)
            return out
        cpu_build.SOURCES = [at(p) for p in sources]
        cpu_build.HEADERS = [h for h in (at(p, needed=False) for p in headers) if h is not None]
        try:
            yield
        finally:
            cpu_build.SOURCES, cpu_build.HEADERS = sources, headers


def against(engine: Engine, other: Engine, rows: list[int], repeats: int, tokens: int) -> dict[int, list[float]]:
    """Per row count, the other engine's step over this one's, alternated (which goes first turns each repeat)."""
    ratios: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(repeats):
        for r in rows:
            ms = {id(e): step_ms(e, r, tokens) for e in ((engine, other) if i % 2 == 0 else (other, engine))}
            ratios[r].append(ms[id(other)] / ms[id(engine)])
    return ratios


def main(argv: list[str] | None = None) -> dict[int, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", metavar="COMMIT")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (a float checkpoint: bfloat16, float32)")
    args = ap.parse_args(argv)
    if args.model is None:
        from perf.bench_spec import default_model
        args.model = default_model()
    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                          max_batch_size=max(args.rows))
    engine = Engine(config, on_delta=lambda d: None)
    step_ms(engine, 1, 8)                                                   # warm-up
    if args.against:
        with kernels_at(args.against):
            other = Engine(config, on_delta=lambda d: None)
        step_ms(other, 1, 8)
        ratios = against(engine, other, args.rows, args.repeats, args.tokens)
        print(f"{args.model}: {args.threads} threads, {cpu_model()}, {cpu_build.described()}; {args.repeats} pairs "
              f"of {args.tokens} tokens, the kernels of {args.against} against these")
        print(table(["rows", f"{args.against}'s step / this one's (pairs' range)"],
                    [[r, f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"] for r, t in ratios.items()]))
        return ratios
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
