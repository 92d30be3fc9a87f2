"""In-process decode tok/s: Pagoda's LLM next to transformers' generate on the same checkpoint, in one run.

    python perf/bench_decode.py --preset qwen2.5-0.5b --dtype float32 --max-tokens 256
Decode rate = (tokens - 1) / (t_last_token - t_first_token), greedy, EOS ignored by both.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig          # noqa: E402
from engine.core.engine import Engine                # noqa: E402
from engine.models.presets import cached_model  # noqa: E402
from perf.inprocess import greedy_run           # noqa: E402


def pagoda_rate(model: str, dtype: str, prompt: list[int], n: int, **options) -> float:
    return greedy_run(Engine(EngineConfig(model=model, dtype=dtype, **options)), prompt, n)[1]


def transformers_rate(model: str, dtype: str, prompt: list[int], n: int) -> float:
    from transformers import Qwen2ForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}[dtype]
    hf = Qwen2ForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    clock = Clock()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    streamer=clock, pad_token_id=0)
    token_times = clock.times[1:]          # the first put() is the prompt
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", action="append", help="tiny | small | qwen2.5-0.5b (repeatable)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for preset in args.preset or ["tiny", "qwen2.5-0.5b"]:
        model = str(cached_model(preset))
        prompt = [random.Random(0).randrange(3, 800) for _ in range(args.prompt_tokens)]
        runs: dict[str, list[float]] = {"pagoda paged": [], "pagoda dense": [], "transformers": []}
        pagoda_rate(model, args.dtype, prompt, 8)           # warm-up
        transformers_rate(model, args.dtype, prompt, 8)
        for _ in range(args.repeats):                       # interleaved, so drift hits both alike
            runs["pagoda paged"].append(pagoda_rate(model, args.dtype, prompt, args.max_tokens))
            runs["pagoda dense"].append(pagoda_rate(model, args.dtype, prompt, args.max_tokens, max_batch_size=1))
            runs["transformers"].append(transformers_rate(model, args.dtype, prompt, args.max_tokens))
        base = statistics.median(runs["transformers"])
        for name, rates in runs.items():
            med = statistics.median(rates)
            rows.append({"preset": preset, "dtype": args.dtype, "engine": name, "median_tok_s": med,
                         "min": min(rates), "max": max(rates), "vs_transformers": med / base})
    print(f"threads={torch.get_num_threads()} new_tokens={args.max_tokens} prompt={args.prompt_tokens}")
    print(f"{'preset':14} {'engine':14} {'tok/s':>9} {'min':>9} {'max':>9} {'x transformers':>15}")
    for r in rows:
        print(f"{r['preset']:14} {r['engine']:14} {r['median_tok_s']:9.1f} {r['min']:9.1f} {r['max']:9.1f} "
              f"{r['vs_transformers']:15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
