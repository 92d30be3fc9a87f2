"""MLX runner decode tok/s next to mlx-lm's generate on the same checkpoint, and lookahead vs synchronous decode
(PAGODA_FORCE_SYNC), in one run, interleaved. Greedy; decode rate = (tokens - 1) / (t_last - t_first).

    python -m perf.bench_mlx [--preset small] [--kv-storage paged|dense] [--max-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.models.presets import cached_model
from perf.common import decode_rate, greedy_run, prompt_ids, ratio_of_pairs


def mlx_lm_rate(model, tokenizer, prompt: list[int], n: int) -> float:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    return decode_rate([time.perf_counter() for _ in stream_generate(model, tokenizer, prompt, max_tokens=n,
                                                                     sampler=make_sampler(temp=0.0))])


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
    runs: dict[str, list[float]] = {"mlx-lm": [], "pagoda mlx lookahead": [], "pagoda mlx sync": []}
    for i in range(args.repeats + 1):
        prompt = prompt_ids(args.prompt_tokens, seed=i)
        n = 8 if i == 0 else args.max_tokens                      # the first round warms up
        rates = {"mlx-lm": mlx_lm_rate(model, tokenizer, prompt, n),
                 "pagoda mlx lookahead": greedy_run(engine, prompt, n, lookahead=True)[1],
                 "pagoda mlx sync": greedy_run(engine, prompt, n, lookahead=False)[1]}
        if i:
            for k, v in rates.items():
                runs[k].append(v)
    print(f"preset {args.preset}, {args.kv_storage} KV, {args.max_tokens} new tokens, {args.repeats} interleaved "
          f"repeats; medians, and the median of per-repeat ratios (paired: drift between repeats cancels)")
    for name, rates in runs.items():
        vs_lm, vs_sync = ratio_of_pairs(rates, runs["mlx-lm"]), ratio_of_pairs(rates, runs["pagoda mlx sync"])
        print(f"{name:22} {statistics.median(rates):8.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})  "
              f"x mlx-lm {vs_lm:.2f}  x sync {vs_sync:.2f}")


if __name__ == "__main__":
    main()
