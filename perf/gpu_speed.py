"""gpu_check's speed sections, in process: decode speed (bs1 against transformers on the same device, lookahead
vs sync, c=4 vs c=1, CUDA graphs on vs off), the seed's hit-vs-miss measurement (paged and dense, contiguous vs
release-order block tables), and the decode-attention microbenchmark. Every comparison is a median of per-pair
ratios, the pairs interleaved ABBA (perf.common)."""
from __future__ import annotations

import statistics
import time

import torch

from client.workload import Workload
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sampling import SamplingParams
from engine.models.presets import cached_model
from perf import bench_attention
from perf.common import decode_rate, median_pair, prompt_ids

SEED_GB10 = 203                   # the seed's best bs1 decode on a GB10, tok/s (182-203)


def run(engine: Engine, prompts: list[list[int]], n: int, lookahead: bool = True) -> dict:
    """Greedy requests added together, EOS ignored: TTFT of the first, its decode rate, the cached tokens, and the
    aggregate decode rate over all (tokens after each one's first / the span of those arrivals)."""
    engine.lookahead.enabled = lookahead
    times: dict[int, list[float]] = {}
    cached: dict[int, int] = {}

    def on_delta(d) -> None:
        times.setdefault(d.request_id, []).extend([time.perf_counter()] * len(d.token_ids))
        cached[d.request_id] = d.cached_tokens
    engine.on_delta = on_delta
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add(engine.make_request(p, params)).id for p in prompts]
    while engine.has_work:
        engine.step()
    first = times[ids[0]]
    firsts = [times[i][0] for i in ids]
    total = sum(len(times[i]) - 1 for i in ids)
    return {"ttft": first[0] - start, "rate": decode_rate(first), "cached": cached[ids[0]],
            "aggregate": total / (max(times[i][-1] for i in ids) - min(firsts))}


def engine(s, **options) -> Engine:
    path = str(cached_model(s.speed_model))
    paged = options.get("kv_storage", "paged") == "paged"
    return Engine(EngineConfig(**{"model": path, "device": s.device, "dtype": "bfloat16",
                                  "attention": s.speed_attention, "max_batch_size": 4 if paged else 1,
                                  "kv_storage": "paged",
                                  "num_kv_blocks": s.blocks if paged else 0, **options}))


def hf_rate(model, prompt: list[int], n: int) -> float:
    """transformers' generate: decode tok/s from the time of n tokens less the time of one."""
    ids = torch.tensor([prompt], device=model.device)

    def timed(k: int) -> float:
        sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        sync()
        return time.perf_counter() - t
    return (n - 1) / (timed(n) - timed(1))


def decode_speed(s) -> tuple[dict, list[dict]]:
    from perf.gpu_correct import hf_model
    on, off = engine(s, cuda_graphs="true"), engine(s, cuda_graphs="false")
    fresh = iter(range(10_000))
    one = lambda e, lookahead=True: run(e, [prompt_ids(64, seed=next(fresh))], s.decode_tokens, lookahead)  # noqa: E731
    many = lambda e, c: run(e, [prompt_ids(64, seed=next(fresh)) for _ in range(c)], s.decode_tokens)  # noqa: E731
    one(on), one(off)                                                          # warm-up
    graphs = median_pair(lambda: one(on)["rate"], lambda: one(off)["rate"], s.pairs)
    lookahead = median_pair(lambda: one(on)["rate"], lambda: one(on, False)["rate"], s.pairs)
    conc = median_pair(lambda: many(on, 4)["aggregate"], lambda: many(on, 1)["aggregate"], s.pairs)
    off = None                                    # its KV pool goes before transformers' model comes
    hf = hf_model(str(cached_model(s.speed_model)), torch.bfloat16, s.device)
    hf_rate(hf, prompt_ids(64), 4)                                             # warm-up
    vs_hf = median_pair(lambda: one(on)["rate"], lambda: hf_rate(hf, prompt_ids(64, seed=next(fresh)),
                                                                 s.decode_tokens), s.pairs)
    out = {"graphs_on_off": graphs._asdict(), "lookahead_sync": lookahead._asdict(), "c4_c1": conc._asdict(),
           "vs_transformers": vs_hf._asdict(), "tokens": s.decode_tokens, "pairs": s.pairs}
    m = s.speed_model
    goals = [
        {"name": f"bs1 decode tok/s, {m} bf16", "value": f"{vs_hf.pagoda:.0f}", "goal": f">= {2 * SEED_GB10}",
         "met": vs_hf.pagoda >= 2 * SEED_GB10},
        {"name": "bs1 decode vs transformers generate", "value": f"{vs_hf.ratio:.2f} ({vs_hf.peer:.0f} tok/s)",
         "goal": ">= 1.5", "met": vs_hf.ratio >= 1.5},
        {"name": "lookahead / sync decode", "value": f"{lookahead.ratio:.3f}", "goal": ">= 1.1",
         "met": lookahead.ratio >= 1.1},
        {"name": "CUDA graphs on / off decode", "value": f"{graphs.ratio:.2f} ({graphs.peer:.0f} tok/s off)",
         "goal": "reported", "met": None},
        {"name": "c=4 / c=1 aggregate decode", "value": f"{conc.ratio:.2f}", "goal": "reported", "met": None},
    ]
    return out, goals


def hit_miss(s) -> tuple[dict, list[dict]]:
    """The seed's measurement: MISS then HIT (all but the last tokens shared) alternated after a warm-up pair."""
    out, goals = {}, []
    for name, options in (("paged", {}), ("paged, release-order blocks", {"contiguous_blocks": False}),
                          ("dense", {"kv_storage": "dense"})):
        e = engine(s, **options)
        w = Workload(s.seed_prompt, seed=0)
        pairs = []
        for i in range(s.pairs + 1):
            miss = w.miss()
            m, h = run(e, [miss], s.seed_tokens), run(e, [w.hit(miss)], s.seed_tokens)
            if i:
                pairs.append((m, h))
        del e
        rate = statistics.median(h["rate"] / m["rate"] for m, h in pairs)
        ttft = statistics.median(h["ttft"] / m["ttft"] for m, h in pairs)
        out[name] = {"hit_miss_decode": rate, "hit_miss_ttft": ttft, "pairs": [[m, h] for m, h in pairs],
                     "miss_rate": statistics.median(m["rate"] for m, _ in pairs),
                     "hit_rate": statistics.median(h["rate"] for _, h in pairs),
                     "cached": f"{pairs[0][1]['cached']}/{s.seed_prompt}"}
        goals.append({"name": f"hit/miss decode, {name}", "value": f"{rate:.3f} (cached {out[name]['cached']})",
                      "goal": "1.00 +- 0.01", "met": abs(rate - 1) <= 0.01})
        goals.append({"name": f"hit/miss TTFT, {name}", "value": f"{ttft:.3f}", "goal": "<= 0.15",
                      "met": ttft <= 0.15})
    paged, shuffled = out["paged"]["hit_rate"], out["paged, release-order blocks"]["hit_rate"]
    goals.append({"name": "release-order / contiguous blocks, hit decode", "value": f"{shuffled / paged:.3f}",
                  "goal": "1.00 +- 0.02", "met": abs(shuffled / paged - 1) <= 0.02})
    return out, goals


def attention(s) -> tuple[dict, list[dict]]:
    device, dtype = torch.device(s.device), torch.bfloat16
    peak = bench_attention.peak_for(device)
    rows = [bench_attention.case(impl, device, dtype, b, c, shuffled, iters=s.iters)
            for impl in ("triton", "reference") for b in s.batches for c in s.contexts for shuffled in (False, True)]
    for r in rows:
        r["pct_peak"] = 100 * r["gbs"] / peak if peak else None
    triton = [r for r in rows if r["impl"] == "triton"]
    ratios = [b["us"] / a["us"] for a, b in zip(triton[::2], triton[1::2])]     # shuffled / contiguous
    worst = max(ratios, key=lambda x: abs(x - 1))
    best = max(triton, key=lambda r: r["gbs"])
    goals = [{"name": "attention kernel: shuffled / contiguous time, worst case", "value": f"{worst:.3f}",
              "goal": "1.00 +- 0.02", "met": abs(worst - 1) <= 0.02},
             {"name": "attention kernel: best GB/s", "value": f"{best['gbs']:.0f}" + (
                 f" ({best['pct_peak']:.0f}% of {peak:.0f})" if peak else " (peak unknown)"),
              "goal": "reported", "met": None}]
    return {"peak_gbs": peak, "rows": rows, "shuffled_over_contiguous": ratios}, goals


def quant_gemv(s) -> tuple[dict, list[dict]]:
    """The GGUF block GEMV (kernels/triton_quant.py): one decode row times a quant_k x quant_k weight in Q4_K and in
    Q8_0, as GB/s of block bytes read. Random bytes below 0x3C (every fp16 scale finite): the values do not change
    the time. On a GPU Triton's do_bench (CUDA events, the L2 cache flushed before each call: the weight fits in
    it); here the interpreter, timed once."""
    import triton

    from engine.kernels import cpu_quant, triton_quant
    k, peak, out, goals = s.quant_k, bench_attention.peak_for(torch.device(s.device)), {}, []
    for name in ("Q4_K", "Q8_0"):
        kind = cpu_quant.TYPES[name]
        weights, nbytes = cpu_quant.BLOCKS[kind]
        blocks = torch.randint(0, 0x3C, (k * k // weights * nbytes,), dtype=torch.uint8, device=s.device)
        x = torch.randn(1, k, device=s.device)
        call = lambda: triton_quant.gemv(x, blocks, [(kind, k, k // weights * nbytes)], (k, k))  # noqa: E731
        call()                                                                 # compiles
        if s.device == "cuda":
            seconds = triton.testing.do_bench(call) / 1e3
        else:
            start = time.perf_counter()
            call()
            seconds = time.perf_counter() - start
        gbs = blocks.numel() / seconds / 1e9
        out[name] = {"us": seconds * 1e6, "gbs": gbs}
        goals.append({"name": f"{name} GEMV 1 x {k} x {k}, GB/s of blocks", "value": f"{gbs:.0f}" + (
            f" ({100 * gbs / peak:.0f}% of {peak:.0f})" if peak else ""), "goal": "reported", "met": None})
    return out, goals
