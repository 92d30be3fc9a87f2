"""How far n-gram speculation could go on bench_spec's workloads on this CPU: the greedy tokens a workload's request
decodes (spec off, after a warm-up, as bench_spec's pairs run), replayed against the proposer with the step costs
this CPU measures (bench_rows' step at 1-32 rows, interpolated). Per workload and concurrency (c identical
requests, as bench_spec sends them):

- policy: the engine's draft lengths (Speculator.drafts' rule over c sequences), a model of what bench_spec
  measures;
- bound: each step drafting exactly the proposal's tokens that will be taken, no more (no draft policy does
  better with this proposer and these step costs).

Both are decode tok/s against one token a one-row step (c rows a step at concurrency c), with the engine's
proposer (indentation matched loosely) and, in the last two columns, with exact matching alone (vLLM's lookup).

    python -m perf.spec_bound [--model FILE|DIR] [--k 8] [--max-tokens 160] [--threads 2]"""
from __future__ import annotations

import argparse

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.ngram import NO_BLANKS, Blanks, Lookup, NgramConfig
from engine.core.sampling import SamplingParams
from engine.core.speculate import Costs, Pace
from perf.bench_rows import step_ms
from perf.bench_spec import SAMPLED, WORKLOADS, default_model, prompt_of, run
from perf.common import cpu_model, table

ROWS = (1, 2, 4, 8, 16, 32)


def costs(engine: Engine) -> dict[int, float]:
    """Milliseconds a decode step of each of ROWS rows (median of 3, interleaved)."""
    step_ms(engine, 1, 8)
    got: dict[int, list[float]] = {r: [] for r in ROWS}
    for _ in range(3):
        for r in ROWS:
            got[r].append(step_ms(engine, r, 24))
    return {r: sorted(t)[1] for r, t in got.items()}


def price(ms: dict[int, float], rows: int) -> float:
    """A step of `rows` rows in milliseconds, linear between the measured counts."""
    known = sorted(ms)
    for lo, hi in zip(known, known[1:]):
        if rows <= hi:
            return ms[lo] + (ms[hi] - ms[lo]) * (rows - lo) / (hi - lo)
    return ms[known[-1]] * rows / known[-1]


def tokens(engine: Engine, prompt: list[int], c: int, max_tokens: int) -> list[int]:
    """The greedy tokens one of c identical requests decodes, the prompt cache warmed as bench_spec's pairs find it."""
    run(engine, [prompt], 8)
    reqs = [engine.make_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)) for _ in range(c)]
    for r in reqs:
        engine.add(r)
    engine.on_delta = lambda d: None
    while engine.has_work:
        engine.step()
    return list(reqs[0].output_ids)


def replay(prompt: list[int], out: list[int], ms: dict[int, float], c: int, k: int, policy: bool,
           costs: Costs = Costs(4), most: int = 32, blanks: Blanks = NO_BLANKS) -> float:
    """Decode tok/s of the replay against c rows a one-row step each (see the module's docstring); `costs`: the
    runner's rows as the engine's draft lengths price them, `most`: the rows a step takes. The policy is the
    engine's (Speculator.drafts: skips, shadow drafts past the cheap rows, each sequence in turn its Pace.length). A
    step drafts no further than the engine lets it: the last token is never a draft. `blanks`: the vocabulary's
    indentation tokens, as the engine's proposer has them (NO_BLANKS: matched exactly)."""
    lookups, paces, at = [Lookup(NgramConfig(k, 2, 5), blanks) for _ in range(c)], [Pace() for _ in range(c)], [0] * c
    spent = 0.0
    while live := [s for s in range(c) if at[s] < len(out)]:
        width, found = len(live), {}
        for s in live:
            pace, room = paces[s], len(out) - at[s] - 1
            if policy and pace.skip:
                pace.skip -= 1
                continue
            n = min(pace.length(k, width, costs) if policy else k, room, most - width)
            draft = lookups[s].propose(prompt, out[:at[s]], n) if n > 0 else []
            if not policy:
                found[s] = draft[:next((j for j, (a, b) in enumerate(zip(draft, out[at[s]:])) if a != b), len(draft))]
            elif draft and width >= costs.cheap and pace.rate < costs.worth(width + 1):
                pace.count(1, int(draft[:1] == out[at[s]:at[s] + 1]))       # a shadow draft
            elif draft:
                found[s] = draft
                width += len(draft)
        rows = sum(1 + len(found.get(s, ())) for s in live)
        spent += price(ms, rows)
        for s in live:
            draft = found.get(s, [])
            took = next((j for j, (a, b) in enumerate(zip(draft, out[at[s]:])) if a != b), len(draft))
            if draft and policy:
                paces[s].record(len(draft), took, costs.worth(rows))
            at[s] += 1 + took
    return len(out) * price(ms, c) / spent


def main(argv: list[str] | None = None) -> list[list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = args.model or default_model()
    engine = Engine(EngineConfig(model=model, num_threads=args.threads, max_batch_size=max(ROWS)),
                    on_delta=lambda d: None)
    ms = costs(engine)
    priced = Costs(engine.runner.cheap_rows, *(engine.runner.row_costs() or ()))
    blanks = Blanks.of(*engine.tokenizer.layout())
    rows = []
    for name, text in WORKLOADS.items():
        if name in SAMPLED:
            continue
        prompt = prompt_of(engine, text)
        for c in (1, 4):
            out = tokens(engine, prompt, c, args.max_tokens)
            rows.append([name, c, len(out)] + [
                f"{replay(prompt, out, ms, c, args.k, policy, priced, max(ROWS), found):.2f}"
                for found in (blanks, NO_BLANKS) for policy in (True, False)])
    print(f"{model}: {args.threads} threads, {cpu_model()}; k={args.k}, prompt_lookup 2-5; a step's ms by rows: "
          + ", ".join(f"{r}: {t:.1f}" for r, t in ms.items()))
    print(table(["workload", "conc", "tokens", "policy (x spec off)", "bound (x spec off)", "policy, exact",
                 "bound, exact"], rows))
    return rows


if __name__ == "__main__":
    main()
