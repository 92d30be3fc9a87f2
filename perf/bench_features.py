"""What each generation feature costs in decode: tok/s with it next to plain greedy decode, one engine, the two
requests alternated in ABBA order; the ratio is the median of per-pair ratios. Greedy unless a row samples, EOS
ignored. n=4 counts the tokens of all four sequences (aggregate tok/s). The JSON schema asks for an array of
max-tokens/3 integers (0-999), so the constrained output has about max-tokens tokens too; its last row compares it
with lookahead off.
The tool_choice "auto" row is the OpenAI server's grammar for two tools in Hermes' format (free text, each
<tool_call> held to the tools) against the same request without it: the price of `auto`'s guarantee while the
model writes text (the vocabulary's size sets it: run it on a preset with the real one, qwen2.5-0.5b).

The sampled rows (seeded) cost what their vocabulary's size sets; top_p's cost depends on how peaked the model's
distribution is, so measure those on real weights (--model FILE|DIR: the registry's Gemma 3 270M, 262k tokens).

    python -m perf.bench_features [--preset small | --model FILE|DIR] [--max-tokens 128] [--repeats 9] [--threads 1]
                                  [--only NAME]
"""
from __future__ import annotations

import argparse

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.models.presets import cached_model
from perf.common import greedy_run, median_pair, prompt_ids, table

FEATURES = {"logprobs=5": {"logprobs": 5}, "logprobs=20": {"logprobs": 20},
            "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
            "n=4 (aggregate)": {"n": 4}, "temperature=0.8": {"temperature": 0.8, "seed": 0},
            "temperature=0.8, top_p=0.95": {"temperature": 0.8, "top_p": 0.95, "seed": 0},
            "temperature=0.8, top_k=64, top_p=0.95": {"temperature": 0.8, "top_k": 64, "top_p": 0.95, "seed": 0}}


def schema(max_tokens: int) -> dict:
    items = max(1, max_tokens // 3)
    return {"json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                     "minItems": items, "maxItems": items}}


def tools_auto() -> dict:
    from engine.core.structured import StructuredOutputs
    from engine.grammar import tool_calls
    zone = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    city = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    return {"structured_outputs": StructuredOutputs(grammar=tool_calls("hermes", [("get_time", zone),
                                                                                 ("get_weather", city)], True))}


def main(argv: list[str] | None = None) -> list[list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", help="a checkpoint directory or GGUF file instead of a preset")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="the rows whose feature name starts with this")
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model or str(cached_model(args.preset)), num_threads=args.threads))
    prompt = prompt_ids()
    greedy_run(engine, prompt, 8)                                          # warm-up
    json = {"structured_outputs": schema(args.max_tokens)}
    cases = [(name, params, {}, "plain") for name, params in FEATURES.items()]
    cases += [("json schema", json, {}, "plain"), ("json schema", json, {**json, "lookahead": False},
                                                    "json schema, lookahead off")]
    cases += [('tool_choice "auto"', tools_auto(), {}, "plain")]
    cases = [c for c in cases if args.only is None or c[0].startswith(args.only)]
    rows = []
    for name, params, base, base_name in cases:
        pair = median_pair(lambda: greedy_run(engine, prompt, args.max_tokens, lookahead=True, **params)[1],
                           lambda: greedy_run(engine, prompt, args.max_tokens, **{"lookahead": True, **base})[1],
                           args.repeats)
        rows.append([name, base_name, f"{pair.pagoda:.1f}", f"{pair.peer:.1f}",
                     f"{pair.ratio:.3f} ({pair.low:.3f}-{pair.high:.3f})"])
    engine.lookahead.enabled = engine.config.use_lookahead
    print(f"{args.model or args.preset}, {args.max_tokens} new tokens, {args.repeats} ABBA pairs, "
          f"torch threads {args.threads}")
    print(table(["feature", "against", "with tok/s", "against tok/s", "ratio (range of pairs)"], rows))
    return rows


if __name__ == "__main__":
    main()
