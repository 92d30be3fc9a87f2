"""perf_analyzer, hit vs miss, interleaved: one --input-data file alternates MISS and HIT prompts (each HIT shares
all but its last tokens with the MISS just before it), and perf_analyzer sends them in order, one at a time
(`-i grpc --streaming`, concurrency 1, a fixed request count), keeping its own timing; drift on the machine falls
on both kinds alike. Each MISS is paired with its HIT, as the bench pairs them, and the hit/miss ratios carry their
95% intervals: from perf_analyzer's response timestamps (the client's view) and from the engine's own decode
timing (return_decode_timing), which perf_analyzer records with each response.

    python -m perf.perf_hit_miss --url 127.0.0.1:8001 --prompt-tokens 471 --max-tokens 192 --pairs 16 \\
        --out perf/results/pa_paged
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from client.workload import Workload
from perf import compare
from perf.common import ROOT

FLAGS = ("return_cached_tokens", "return_num_input_tokens", "return_decode_timing")


def input_data(prompts: list[list[int]], params: dict) -> dict:
    return {"data": [{"input_ids": {"content": p, "shape": [len(p)]}, "stream": [True],
                      "sampling_parameters": [json.dumps(params)], **{flag: [True] for flag in FLAGS}}
                     for p in prompts]}


def interleaved(w: Workload, pairs: int) -> list[list[int]]:
    """MISS, HIT(of that MISS), MISS, HIT, ...: fresh prompts, none repeating within the workload."""
    prompts = []
    for _ in range(pairs):
        miss = w.miss()
        prompts += [miss, w.hit(miss)]
    return prompts


def perf_analyzer(url: str, model: str, data: Path, export: Path, requests: int, version: str = "1") -> bool:
    """One perf_analyzer run; False when it exited 0 but left its export empty, which 2.51 does now and then."""
    export.unlink(missing_ok=True)            # perf_analyzer refuses to overwrite an export
    # -x: with no version named, perf_analyzer picks the one whose server-side stats changed during the run, and
    # fails ("failed to find the requested model version") when its last snapshot beats the server's stats update
    cmd = [sys.executable, "-m", "scripts.perf_analyzer", "-m", model, "-x", version, "-u", url, "-i", "grpc",
           "--streaming", "--input-data", str(data), "--concurrency-range", "1", "--request-count", str(requests),
           "--stability-percentage", "1000", "--profile-export-file", str(export)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        text = run.stdout + run.stderr
        raise SystemExit(f"perf_analyzer failed ({run.returncode}): {' '.join(cmd)}\n{text[:1500]}\n...\n"
                         f"{text[-1500:]}")
    return export.exists() and export.stat().st_size > 0


def profile(args: argparse.Namespace, w: Workload, pairs: int, params: dict, export: Path, tries: int = 3) -> dict:
    """perf_analyzer's export of `pairs` interleaved MISS/HIT pairs. An empty export is run again, on fresh prompts
    (the last try's are cached now)."""
    data = export.with_name(export.stem + "_input.json")
    for _ in range(tries):
        data.write_text(json.dumps(input_data(interleaved(w, pairs), params)))
        if perf_analyzer(args.url, args.model, data, export, 2 * pairs, args.model_version):
            return json.loads(export.read_text())
        print(f"perf_analyzer exited 0 but left {export.name} empty; running it again", file=sys.stderr)
    raise SystemExit(f"perf_analyzer left {export} empty {tries} times")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--model-version", default="1")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--hit-suffix", type=int, default=23)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=8, help="MISS/HIT pairs measured, after the warm-up pairs")
    ap.add_argument("--warmup", type=int, default=1, help="pairs run first and left out")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--vocab-high", type=int, default=900)
    ap.add_argument("--first-tokens", default="450:900", help="LO:HI, the range of MISS prompts' first tokens "
                    "(disjoint from other workloads' on the same server)")
    ap.add_argument("--out", default=str(ROOT / "perf/results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    w = Workload(args.prompt_tokens, args.hit_suffix, args.seed, high=args.vocab_high,
                        first=range(*map(int, args.first_tokens.split(":"))))
    export = profile(args, w, args.warmup + args.pairs, params, out / "pa_run.json")
    result = compare.compare(export, args.warmup)
    print(compare.table(result))
    compare.plot(result, str(out / "pa_hit_vs_miss.png"))
    (out / "pa_compare.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
