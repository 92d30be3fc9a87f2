"""Pagoda next to its peers, in one run on this machine: every row is a ratio Pagoda / peer with its goal.

    python -m perf.bench_peers [--quick] [--out perf/results]
1. in-process decode tok/s, LLM vs transformers generate: qwen2.5-0.5b fp32 and bf16, and tiny (per-token overhead)
   (no --compile rows: fp32 decode on a CPU runs the fused C kernels, which outrun the compiled graph, so compile
   stands down there)
2. the memory roofline: read bandwidth of a >= 1 GiB tensor sum / bytes of weights read per token, and the
   ceilings a GEMV pass allows (one token over every weight matrix, nothing else): Pagoda's CPU GEMV kernel and
   torch's own F.linear, which transformers decodes under
3. aggregate decode tok/s at concurrency 1, 2, 4 (paged, in process)
4. lookahead vs PAGODA_FORCE_SYNC, torch and MLX runners
5. decode tok/s through tritonserver gRPC streaming vs in process, same model and threads: small (where a token
   takes about a millisecond, so the serving path's fixed cost a token shows) and qwen2.5-0.5b
6. the MLX runner vs mlx-lm generate (small)
7. llama.cpp (llama-cpp-python, built here on first use: perf/llama_peer.py) on the same checkpoint converted by its
   own convert_hf_to_gguf.py, same threads: fp32 and bf16 decode after a 64-token prompt, paged KV and dense
   (max_batch_size=1), and prefill of a 512-token prompt (tokens / TTFT); each row names the instruction sets each
   engine's CPU kernels were built with. Left out, with the reason, where it cannot be built.
8. GGUF files: Q8_0 and Q4_K_M made from qwen2.5-0.5b by llama.cpp's own converter and quantizer, and the
   registry's real Gemma 3 270M Q4_K_M, both engines reading the same file: decode and 512-token prefill
9. every other family at its real geometry, bf16 decode, vs transformers and llama.cpp (perf/bench_families.py)
Rates are medians of repeats interleaved in ABBA order; a ratio is the median of the per-pair ratios, so drift
between pairs on a shared machine cancels. Decode tok/s = (tokens - 1) / (t_last - t_first).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sampling import SamplingParams
from engine.kernels import cpu_build
from engine.models.presets import cached_model
from perf import bench_families, bench_gguf, bench_roofline, llama_peer
from perf.bench_decode import transformers_rate
from perf.common import ROOT, Pair, cpu_model, greedy_run, median_pair, paired, prompt_ids, table

# Each row's goal: it is met when Pagoda / peer >= goal.
GOALS = {
    "decode fp32": 1.05, "decode bf16": 1.0, "decode tiny": 2.5,
    "roofline sum": 0.90, "roofline gemv": 0.90, "roofline linear": 0.90,
    "concurrency 2": 1.0, "concurrency 4": 2.5,
    "lookahead torch": 0.98, "lookahead mlx": 1.15,
    "triton small": 0.90, "triton big": 0.90,
    "mlx-lm": 1.0,
    "llama.cpp fp32": 1.1, "llama.cpp bf16": 1.0, "llama.cpp prefill": 1.0,
    "gguf decode": 1.1, "gguf prefill": 1.0,
}


def in_process(preset: str, dtype: str, tokens: int, repeats: int, threads: int) -> Pair:
    model = str(cached_model(preset))
    engine = Engine(EngineConfig(model=model, dtype=dtype, num_threads=threads))
    p = prompt_ids()
    greedy_run(engine, p, 8), transformers_rate(model, dtype, p, 8)                           # warm-up
    return median_pair(lambda: greedy_run(engine, p, tokens)[1], lambda: transformers_rate(model, dtype, p, tokens),
                       repeats)


def aggregate(engine: Engine, concurrency: int, tokens: int) -> float:
    """Decoded tokens per second over all requests, from when every request has its first token to the end."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    times: list[float] = []
    firsts: dict[int, float] = {}

    def arrived(d) -> None:
        now = time.perf_counter()
        firsts.setdefault(d.request_id, now)
        times.extend([now] * len(d.token_ids))
    engine.on_delta = arrived
    for i in range(concurrency):
        engine.add(engine.make_request(prompt_ids(seed=100 + i), params))
    while engine.has_work:
        engine.step()
    start = max(firsts.values())
    return sum(1 for t in times if t > start) / (times[-1] - start)


def lookahead(preset: str, runner: str, tokens: int, repeats: int, threads: int) -> Pair:
    """One engine, its lookahead switched on and off between requests (the PAGODA_FORCE_SYNC path): two identical
    engines built one after the other differ by build order alone (docs/performance.md)."""
    engine = Engine(EngineConfig(model=str(cached_model(preset)), runner=runner, num_threads=threads))
    p = prompt_ids()
    greedy_run(engine, p, 8, lookahead=True), greedy_run(engine, p, 8, lookahead=False)
    return median_pair(lambda: greedy_run(engine, p, tokens, lookahead=True)[1],
                       lambda: greedy_run(engine, p, tokens, lookahead=False)[1], repeats)


def through_triton(preset: str, tokens: int, repeats: int, threads: int) -> Pair:
    from client.stream import stream_grpc
    from scripts.tritonserver import launch
    model = str(cached_model(preset))
    params = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    server = launch({"PAGODA_MODEL": model, "PAGODA_NUM_THREADS": str(threads)},
                    Path(tempfile.mkdtemp(prefix="pagoda-peers-")) / "tritonserver.log")
    engine = Engine(EngineConfig(model=model, num_threads=threads))
    greedy_run(engine, prompt_ids(seed=1), 8)
    seeds = itertools.count(10), itertools.count(10)        # each side decodes the same prompts, in turn
    try:
        stream_grpc(server.grpc_url, "llm", prompt_ids(seed=1), params)
        # interleaved: the server idles while the engine here runs
        return median_pair(lambda: stream_grpc(server.grpc_url, "llm", prompt_ids(seed=next(seeds[0])),
                                               params).decode_rate,
                           lambda: greedy_run(engine, prompt_ids(seed=next(seeds[1])), tokens)[1], repeats)
    finally:
        server.stop()


def mlx_vs_mlx_lm(preset: str, tokens: int, repeats: int) -> Pair:
    from mlx_lm import load

    from perf.bench_mlx import mlx_lm_rate
    model = str(cached_model(preset))
    lm, tok = load(model)
    engine = Engine(EngineConfig(model=model, runner="mlx"))
    p = prompt_ids()
    greedy_run(engine, p, 8), mlx_lm_rate(lm, tok, p, 8)
    return median_pair(lambda: greedy_run(engine, p, tokens)[1], lambda: mlx_lm_rate(lm, tok, p, tokens), repeats)


def llama_cpp_rows(preset: str, threads: int, tokens: int, repeats: int) -> list[dict]:
    """Pagoda / llama.cpp, fp32 and bf16: decode with paged KV (the default, max_batch_size 4) and dense
    (max_batch_size=1), and 512-token prefill; each row names the instruction sets each engine's kernels were built
    with here. None (and the reason, printed) where llama-cpp-python cannot be built."""
    tree, why = llama_peer.build()
    if tree is None:
        print(f"llama.cpp rows left out: {why}")
        return []
    rows = []
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        decode, prefill = llama_peer.compare(tree, cached_model(preset), dtype, threads, tokens, repeats)
        dense, _ = llama_peer.compare(tree, cached_model(preset), dtype, threads, tokens, repeats, prefill=0,
                                      config={"max_batch_size": 1})
        rows += [paired_row("vs llama.cpp", f"{preset} {short} decode, paged KV", decode, f"llama.cpp {short}"),
                 paired_row("vs llama.cpp", f"{preset} {short} decode, dense KV", dense, f"llama.cpp {short}"),
                 paired_row("vs llama.cpp", f"{preset} {short} 512-token prefill", prefill, "llama.cpp prefill")]
    return labelled(rows)


def labelled(rows: list[dict]) -> list[dict]:
    """llama.cpp's rows with the CPU and the instruction sets each engine's kernels were built with here."""
    isa = f"{cpu_build.described()} / {llama_peer.instruction_sets()}"
    return [{**r, "cpu": cpu_model(), "isa": isa} for r in rows]


def row(section: str, what: str, pagoda: float, peer: float, goal: float, unit: str = "tok/s",
        ratio: float | None = None) -> dict:
    if ratio is None:
        ratio = pagoda / peer if peer else float("nan")
    return {"section": section, "what": what, "pagoda": pagoda, "peer": peer, "ratio": ratio, "goal": goal,
            "unit": unit, "met": ratio >= goal}


def paired_row(section: str, what: str, pair: Pair, goal: str, every_pair: bool = False) -> dict:
    """A row of the median per-pair ratio and its range; met by the median, or with `every_pair` by the least."""
    r = row(section, what, pair.pagoda, pair.peer, GOALS[goal], ratio=pair.ratio)
    r.update(low=pair.low, high=pair.high)
    if every_pair:
        r["met"] = pair.low >= r["goal"]
    return r


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1))
    labels = [f"{r['section']}: {r['what']}" for r in rows]
    ax.barh(labels, [r["ratio"] for r in rows], color=["tab:green" if r["met"] else "tab:red" for r in rows])
    ax.scatter([r["goal"] for r in rows], labels, marker="|", s=300, color="black", label="goal")
    ax.invert_yaxis()
    ax.set(xlabel="Pagoda / peer", title="Pagoda against its peers (this machine, one run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    from tqdm import tqdm
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (a smoke run, not numbers)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(ROOT / "perf/results"))
    ap.add_argument("--only", action="append", metavar="SECTION", help="run only this section (repeatable)")
    args = ap.parse_args(argv)
    n, reps = (16, 1) if args.quick else (256, 2)
    small_n, small_reps = (16, 1) if args.quick else (128, 15)
    big = "tiny" if args.quick else "qwen2.5-0.5b"
    big_n, big_reps = (16, 1) if args.quick else (64, 3)          # roofline runs; served 0.5B (~8 tok/s)
    t = args.threads
    decode, look = "in-process vs transformers", "lookahead vs sync"

    steps = [
        ("decode", lambda: [paired_row(decode, f"{big} fp32", in_process(big, "float32", n, reps, t), "decode fp32"),
                            paired_row(decode, f"{big} bf16", in_process(big, "bfloat16", n, reps, t), "decode bf16"),
                            paired_row(decode, "tiny fp32", in_process("tiny", "float32", small_n, small_reps, t),
                                       "decode tiny")]),
        ("roofline", lambda: bench_roofline.rows(big, t, big_n, reps if args.quick else 8)),
        ("concurrency", lambda: concurrency_rows(t, small_n, small_reps)),
        ("lookahead", lambda: [paired_row(look, "torch small", lookahead("small", "torch", small_n, small_reps, t),
                                          "lookahead torch"),
                               paired_row(look, "mlx small", lookahead("small", "mlx", small_n, small_reps, t),
                                          "lookahead mlx")]),
        ("triton", lambda: [paired_row("tritonserver vs in-process", "small, 1 thread each",
                                       through_triton("small", small_n, small_reps, 1), "triton small"),
                            paired_row("tritonserver vs in-process", f"{big}, 1 thread each",
                                       through_triton(big, big_n, big_reps, 1), "triton big")]),
        ("mlx", lambda: [paired_row("mlx runner vs mlx-lm", "small", mlx_vs_mlx_lm("small", small_n, small_reps),
                                    "mlx-lm")]),
        ("llama.cpp", lambda: llama_cpp_rows("tiny-qwen" if args.quick else "qwen2.5-0.5b", t,
                                             16 if args.quick else 128, 2 if args.quick else 4)),
        ("gguf", lambda: bench_gguf.rows(bench_gguf.QUICK if args.quick else bench_gguf.FILES, t,
                                         16 if args.quick else 128, 2 if args.quick else 4)),
        ("families", lambda: bench_families.rows(bench_families.QUICK if args.quick else bench_families.PRESETS, t,
                                                 16 if args.quick else 128, 1 if args.quick else 3)),
    ]
    rows: list[dict] = []
    if set(args.only or []) - {name for name, _ in steps}:
        ap.error(f"--only: the sections are {', '.join(name for name, _ in steps)}")
    steps = [(name, step) for name, step in steps if not args.only or name in args.only]
    for name, step in tqdm(steps, desc="bench-peers", unit="section", file=sys.stderr):
        rows += step()
    print(f"\nPagoda vs peers, {time.strftime('%Y-%m-%d')}, torch threads {t}"
          f"{' (quick: smoke only)' if args.quick else ''}")
    print(f"CPU: {cpu_model()}; Pagoda's kernels built for {cpu_build.described()}")
    print(table(["section", "what", "pagoda", "peer", "ratio (range)", "goal", "met", "CPU: built for (pagoda / peer)"],
                [[r["section"], r["what"], f"{r['pagoda']:.1f}", f"{r['peer']:.1f}", ratio_text(r),
                  f"{r['goal']:.2f}", "yes" if r["met"] else "NO", f"{r['cpu']}: {r['isa']}" if "isa" in r else ""]
                 for r in rows], left=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_peers.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "bench_peers.png")
    return rows


def ratio_text(r: dict) -> str:
    low, high = r.get("low", float("nan")), r.get("high", float("nan"))
    return f"{r['ratio']:.2f}" if low != low else f"{r['ratio']:.2f} ({low:.2f}-{high:.2f})"


def concurrency_rows(threads: int, tokens: int, repeats: int) -> list[dict]:
    engine = Engine(EngineConfig(model=str(cached_model("small")), max_batch_size=4, kv_storage="paged",
                                 num_threads=threads))
    greedy_run(engine, prompt_ids(), 8)
    runs: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for _ in range(repeats):                         # interleaved, so drift on a shared machine hits all three
        for c in runs:
            runs[c].append(aggregate(engine, c, tokens))
    return [paired_row("aggregate decode (paged)", f"small c={c} vs c=1", paired(runs[c], runs[1]), f"concurrency {c}")
            for c in (2, 4)]


if __name__ == "__main__":
    main()
