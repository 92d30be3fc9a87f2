"""perf_analyzer, hit vs miss: writes --input-data files (a HIT set whose prompts share all but their last tokens
with a prefix that is warmed first; a MISS set whose prompts never share a first token), runs perf_analyzer on
each (`-i grpc --streaming`, a fixed request count, concurrency 1) and compares the two exports.

    python -m perf.perf_hit_miss --url 127.0.0.1:8001 --prompt-tokens 471 --max-tokens 128 --requests 8 \\
        --out perf/results/paged
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from client.stream import stream_grpc
from client.workload import Workload
from perf import compare
from perf.common import ROOT


def input_data(prompts: list[list[int]], params: dict) -> dict:
    return {"data": [{"input_ids": {"content": p, "shape": [len(p)]}, "stream": [True],
                      "sampling_parameters": [json.dumps(params)], "return_cached_tokens": [True],
                      "return_num_input_tokens": [True]} for p in prompts]}


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


def profile(args: argparse.Namespace, w: Workload, prefix: list[int], kind: str, requests: int, params: dict,
            export: Path, tries: int = 3) -> dict:
    """perf_analyzer's export of `requests` MISS or HIT requests. An empty export is run again, on fresh prompts
    (the last try's may be cached now)."""
    out = export.parent
    for _ in range(tries):
        prompts = [w.miss() if kind == "miss" else w.hit(prefix) for _ in range(3 * requests)]   # 3x spare
        (out / f"pa_input_{kind}.json").write_text(json.dumps(input_data(prompts, params)))
        if perf_analyzer(args.url, args.model, out / f"pa_input_{kind}.json", export, requests, args.model_version):
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
    ap.add_argument("--requests", type=int, default=8, help="requests per kind, split over the rounds")
    ap.add_argument("--rounds", type=int, default=2, help="alternating MISS/HIT perf_analyzer runs")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--vocab-high", type=int, default=900)
    ap.add_argument("--out", default=str(ROOT / "perf/results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    w = Workload(args.prompt_tokens, args.hit_suffix, args.seed, high=args.vocab_high)
    prefix = w.miss()
    stream_grpc(args.url, args.model, prefix, params)            # warm the shared prefix
    per_round = max(1, args.requests // args.rounds)
    exports: dict[str, list[dict]] = {"miss": [], "hit": []}
    for i in range(args.rounds):
        for kind in ("miss", "hit"):    # fresh prompts each round: none repeats within the run
            exports[kind].append(profile(args, w, prefix, kind, per_round, params, out / f"pa_{kind}_{i}.json"))
    result = compare.compare(exports["miss"], exports["hit"])
    print(compare.table(result))
    compare.plot(result, str(out / "pa_hit_vs_miss.png"))
    (out / "pa_compare.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
