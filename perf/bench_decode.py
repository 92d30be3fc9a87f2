"""In-process decode tok/s: Pagoda's LLM next to transformers' generate on the same checkpoint, in one run.

    python -m perf.bench_decode --preset qwen2.5-0.5b --dtype float32 --max-tokens 256
Decode rate = (tokens - 1) / (t_last_token - t_first_token), greedy, EOS ignored by both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.models.presets import cached_model
from perf.common import decode_rate, greedy_run, prompt_ids, table


def pagoda_rate(model: str, dtype: str, prompt: list[int], n: int, **options) -> float:
    return greedy_run(Engine(EngineConfig(model=model, dtype=dtype, **options)), prompt, n)[1]


def transformers_rate(model: str, dtype: str, prompt: list[int], n: int) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    clock = Clock()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    streamer=clock, pad_token_id=0)
    return decode_rate(clock.times[1:])          # the first put() is the prompt


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
        prompt = prompt_ids(args.prompt_tokens)
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
    print(table(["preset", "engine", "tok/s", "min", "max", "x transformers"],
                [[r["preset"], r["engine"], f"{r['median_tok_s']:.1f}", f"{r['min']:.1f}", f"{r['max']:.1f}",
                  f"{r['vs_transformers']:.2f}"] for r in rows], left=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
