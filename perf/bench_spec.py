"""N-gram speculative decoding on real weights: decode tok/s with speculation against without, per workload and k,
at concurrency 1 and 4, greedy (both engines write the same tokens; EOS ends them). A pair runs both engines in
lockstep, a step of one and then a step of the other (which goes first alternates), each timed on its own steps, so
that the VM's changes of speed, which move within seconds, fall on both alike. Input-grounded
workloads (rewrite a code file with one name changed, repeat a passage with one sentence changed, continue a
document that quotes itself), greedy free writing, and a control: free writing sampled (temperature 0.8).
Random-weight presets do not copy their input, so the model is a real checkpoint: the registry's Gemma 3 270M
(GGUF) unless --model names another.

    python -m perf.bench_spec [--model FILE|DIR] [--ks 2 4 8] [--pairs 3] [--max-tokens 160] [--threads 2]

Prints a table (ratio: median of per-pair ratios, with the pairs' range), writes perf/results/bench_spec.json and
.png."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sampling import SamplingParams
from perf.common import ROOT, cpu_model, decode_rate, paired, table

CODE = (ROOT / "engine" / "core" / "ngram.py").read_text().split("\n\n\n")[1][:1400]
PASSAGE = ("Prompt lookup decoding guesses the next tokens by matching the last few tokens of the text against the "
           "prompt. When the output repeats the input, the guesses are right and several tokens are checked in one "
           "step. Reading the weights once per step is what bounds decode on a CPU. So a step that checks four "
           "tokens costs little more than a step that produces one. When the output does not repeat the input, "
           "nothing is guessed and nothing is lost.")
# As completions (a base model, such as the registry's Gemma 3 270M, continues text; a model with a chat template
# gets them as a user turn)
WORKLOADS = {
    "rewrite code": f"Original code:\n```python\n{CODE}\n```\n\nThe same code with the name `config` renamed to "
                    "`settings`:\n```python\n",
    "repeat passage": f"Original passage:\n{PASSAGE}\n\nThe same passage with its sentence about the CPU now about a "
                      "GPU:\n",
    "quoting document": f"{PASSAGE}\n\nAs the text above says, \"Prompt lookup decoding guesses",
    "greedy free writing": "The lighthouse keeper found the bottle on a grey morning in November. Inside it",
    "control (sampled free writing)": "The lighthouse keeper found the bottle on a grey morning in November. Inside it",
}
# the control samples (temperature 0.8, seeded, EOS ignored): a small base model's greedy free writing loops, which
# is input-grounded in its way; sampled, it rarely repeats itself
SAMPLED = {"control (sampled free writing)": {"temperature": 0.8, "ignore_eos": True}}


def default_model() -> str:
    from scripts.gemma3_270m import hf_dir
    return str(next(hf_dir().parent.glob("*.gguf")))


def prompt_of(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    if tok.chat_template:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    return tok.encode_prompt(text)


def counts(engine: Engine) -> tuple[float, float]:
    """The engine's draft and accepted tokens so far."""
    m = engine.metrics
    return m.spec_draft_tokens._value.get(), m.spec_accepted._value.get()


def add(engine: Engine, prompts: list[list[int]], max_tokens: int, **params) -> None:
    """The prompts as requests, greedy unless `params` (more SamplingParams) say otherwise, then seeded by index."""
    for i, p in enumerate(prompts):
        sampling = {"temperature": 0.0, **params} | ({"seed": i} if params else {})
        engine.add(engine.make_request(p, SamplingParams(max_tokens=max_tokens, **sampling)))


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, **params) -> tuple[float, float, float, float]:
    """All prompts at once (`params` as add's): (aggregate decode tok/s, median TTFT s, draft tokens, accepted
    tokens)."""
    times: dict[int, list[float]] = {}
    drafted, accepted = counts(engine)
    engine.on_delta = lambda d: times.setdefault(d.request_id, []).extend([time.perf_counter()] * len(d.token_ids))
    start = time.perf_counter()
    add(engine, prompts, max_tokens, **params)
    while engine.has_work:
        engine.step()
    firsts = [t[0] for t in times.values() if t]
    tokens = sum(len(t) - 1 for t in times.values())
    span = max(t[-1] for t in times.values()) - min(firsts)
    rate = tokens / span if len(prompts) > 1 else decode_rate(next(iter(times.values())))
    now = counts(engine)
    return rate, statistics.median(f - start for f in firsts), now[0] - drafted, now[1] - accepted


@dataclass(slots=True)
class Timed:
    """One engine's share of a lockstep pair, on its own clock: decode tok/s, median TTFT, draft and accepted tokens."""
    rate: float
    ttft: float
    drafted: float
    accepted: float


@dataclass(slots=True)
class _Side:
    engine: Engine
    requests: int
    got: dict[int, int] = field(default_factory=dict)         # tokens so far, by request
    firsts: dict[int, float] = field(default_factory=dict)    # the clock at each request's first token
    clock: float = 0.0                                         # seconds in this engine's own steps
    decode: float = 0.0                                        # of those, once every request has its first token
    tokens: int = 0                                            # tokens of those steps
    spec: tuple[float, float] = (0.0, 0.0)                     # the draft and accepted counters at the start

    def step(self) -> None:
        began, before = len(self.got) == self.requests, sum(self.got.values())
        start = time.perf_counter()
        self.engine.step()
        took = time.perf_counter() - start
        self.clock += took
        for rid in self.got.keys() - self.firsts.keys():
            self.firsts[rid] = self.clock
        if began:
            self.decode += took
            self.tokens += sum(self.got.values()) - before

    def timed(self) -> Timed:
        rate = self.tokens / self.decode if self.decode else float("nan")
        drafted, accepted = counts(self.engine)
        return Timed(rate, statistics.median(self.firsts.values()), drafted - self.spec[0], accepted - self.spec[1])


def lockstep(engines: list[Engine], prompts: list[list[int]], max_tokens: int, first: int = 0,
             **params) -> list[Timed]:
    """The same prompts through every engine at once (`params` as add's), a step of each in turn, the engine at
    `first` starting and the order reversed each round. Each engine's clock runs only in its own steps: its decode
    rate is the tokens of the steps after every request's first token over those steps' time, its TTFT each
    request's own steps up to its first token."""
    sides = []
    for e in engines:
        side = _Side(e, len(prompts), spec=counts(e))
        e.on_delta = lambda d, got=side.got: got.__setitem__(d.request_id, got.get(d.request_id, 0) + len(d.token_ids))
        add(e, prompts, max_tokens, **params)
        sides.append(side)
    order = sides[first:] + sides[:first]
    while any(side.engine.has_work for side in sides):
        for side in order:
            if side.engine.has_work:
                side.step()
        order.reverse()
    return [side.timed() for side in sides]


def lookup_cost(tokenizer, prompt_tokens: int = 16384, steps: int = 2000) -> tuple[float, float]:
    """The proposer on a long prompt of code (the engine's own sources, whose indentation it also matches loosely):
    (ms to index it at the first proposal, µs per later step of one new token)."""
    import random

    from engine.core.ngram import Blanks, Lookup, NgramConfig
    rng = random.Random(0)
    code = "\n\n".join(path.read_text() for path in sorted((ROOT / "engine").rglob("*.py")))
    prompt, output = tokenizer.encode(code)[:prompt_tokens], []
    lookup = Lookup(NgramConfig(4, 2, 5), Blanks.of(*tokenizer.layout()))
    start = time.perf_counter()
    lookup.propose(prompt, output, 4)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        output.append(rng.choice(prompt))
        lookup.propose(prompt, output, 4)
    return first * 1000, (time.perf_counter() - start) / steps * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--lookup", type=int, nargs=2, default=[2, 5], metavar=("MIN", "MAX"))
    ap.add_argument("--only", help="the workloads whose name starts with this")
    ap.add_argument("--out", default=str(ROOT / "perf" / "results" / "bench_spec"))
    args = ap.parse_args(argv)
    model = args.model or default_model()
    base = {"model": model, "num_threads": args.threads, "max_batch_size": max(args.concurrency)}
    off = Engine(EngineConfig(**base))
    rows, out, priced = [], [], []
    workloads = {k: v for k, v in WORKLOADS.items() if args.only is None or k.startswith(args.only)}
    for k in args.ks:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.lookup[0],
                "prompt_lookup_max": args.lookup[1]}
        on = Engine(EngineConfig(**base, speculative_config=json.dumps(spec)))
        costs = on.spec.costs
        priced.append(f"k={k}: {costs.row:.2f} of a one-row step a row within {costs.cheap} rows, "
                      f"{costs.late:.2f} past them, {costs.sampled:.2f} more drawn at a temperature")
        for name, text in workloads.items():
            prompt = prompt_of(off, text)
            for c in args.concurrency:
                prompts = [prompt] * c
                run(on, prompts[:1], 8), run(off, prompts[:1], 8)                   # warm-up
                a, b = [], []
                for i in range(args.pairs):
                    x, y = lockstep([on, off], prompts, args.max_tokens, i % 2, **SAMPLED.get(name, {}))
                    a.append(x), b.append(y)
                pair = paired([x.rate for x in a], [x.rate for x in b])
                drafted, taken = sum(x.drafted for x in a), sum(x.accepted for x in a)
                row = {"workload": name, "k": k, "concurrency": c, "on_tok_s": pair.pagoda, "off_tok_s": pair.peer,
                       "ratio": pair.ratio, "low": pair.low, "high": pair.high, "acceptance": taken / drafted
                       if drafted else None, "ttft_on_s": statistics.median(x.ttft for x in a),
                       "ttft_off_s": statistics.median(x.ttft for x in b)}
                out.append(row)
                rows.append([name, k, c, f"{pair.pagoda:.1f}", f"{pair.peer:.1f}",
                             f"{pair.ratio:.2f} ({pair.low:.2f}-{pair.high:.2f})",
                             "-" if not drafted else f"{taken / drafted:.2f}",
                             f"{row['ttft_on_s'] * 1000:.0f} / {row['ttft_off_s'] * 1000:.0f}"])
        del on
    index_ms, step_us = lookup_cost(off.tokenizer)
    print(f"proposer on a 16,384-token prompt of code: {index_ms:.1f} ms to index it (once), {step_us:.1f} µs a "
          "step after")
    print(f"{Path(model).name}, {args.max_tokens} new tokens at most (greedy, EOS ends), {args.pairs} pairs in "
          f"lockstep, {args.threads} threads, prompt_lookup {args.lookup[0]}-{args.lookup[1]}; {cpu_model()}")
    print("rows as the engine priced them at load: " + "; ".join(priced))
    print(table(["workload", "k", "conc", "spec tok/s", "off tok/s", "ratio (pairs' range)", "accepted/draft",
                 "TTFT on/off ms"], rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    plot(out, args.out + ".png")
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["workload"] for r in rows))
    keys = list(dict.fromkeys((r["k"], r["concurrency"]) for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(keys)
    for j, (k, c) in enumerate(keys):
        got = {r["workload"]: r for r in rows if (r["k"], r["concurrency"]) == (k, c)}
        xs = [i + j * width for i in range(len(names))]
        ys = [got[n]["ratio"] for n in names]
        err = [[got[n]["ratio"] - got[n]["low"] for n in names], [got[n]["high"] - got[n]["ratio"] for n in names]]
        ax.bar(xs, ys, width, yerr=err, label=f"k={k}, concurrency {c}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("decode tok/s, speculation / without")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
