"""MLX runner decode tok/s next to mlx-lm's generate on the same checkpoint, and lookahead vs synchronous decode
(PAGODA_FORCE_SYNC), in one run, interleaved. Greedy; decode rate = (tokens - 1) / (t_last - t_first).

    python perf/bench_mlx.py [--preset small] [--kv-storage paged|dense] [--max-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig          # noqa: E402
from engine.core.engine import Engine                # noqa: E402
from engine.models.presets import cached_model  # noqa: E402
from perf.inprocess import greedy_run            # noqa: E402


def mlx_lm_rate(model, tokenizer, prompt: list[int], n: int) -> float:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    times = [time.perf_counter() for _ in stream_generate(model, tokenizer, prompt, max_tokens=n,
                                                          sampler=make_sampler(temp=0.0))]
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-storage", default="paged", choices=["paged", "dense"])
    args = ap.parse_args()
    from mlx_lm import load
    path = str(cached_model(args.preset))
    model, tokenizer = load(path)
    # one engine, its lookahead switched per request: two identical engines differ by build order alone
    engine = Engine(EngineConfig(model=path, runner="mlx", kv_storage=args.kv_storage))
    rng = random.Random(0)
    runs: dict[str, list[float]] = {"mlx-lm": [], "pagoda mlx lookahead": [], "pagoda mlx sync": []}
    for i in range(args.repeats + 1):
        prompt = [rng.randrange(3, 800) for _ in range(args.prompt_tokens)]
        n = 8 if i == 0 else args.max_tokens                      # the first round warms up
        rates = {"mlx-lm": mlx_lm_rate(model, tokenizer, prompt, n),
                 "pagoda mlx lookahead": greedy_run(engine, prompt, n, lookahead=True)[1],
                 "pagoda mlx sync": greedy_run(engine, prompt, n, lookahead=False)[1]}
        if i:
            for k, v in rates.items():
                runs[k].append(v)
    print(f"preset {args.preset}, {args.kv_storage} KV, {args.max_tokens} new tokens, {args.repeats} interleaved repeats; medians, and "
          f"the median of per-repeat ratios (paired: drift between repeats cancels)")
    for name, rates in runs.items():
        vs_lm = statistics.median(a / b for a, b in zip(rates, runs["mlx-lm"]))
        vs_sync = statistics.median(a / b for a, b in zip(rates, runs["pagoda mlx sync"]))
        print(f"{name:22} {statistics.median(rates):8.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})  "
              f"x mlx-lm {vs_lm:.2f}  x sync {vs_sync:.2f}")

if __name__ == "__main__":
    main()
