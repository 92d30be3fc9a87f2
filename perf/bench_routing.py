"""Routing across replicas: the same multi-tenant workload through vllm-router under round_robin, cache_aware,
kv_aware and kv_aware with session affinity, each on a fresh cluster (scripts/cluster.py), in one run.

    python -m perf.bench_routing [--replicas 2] [--tenants 8] [--requests 96] [--concurrency 4]
        [--system-words 200] [--kv-blocks 128] [--json OUT] [--plot OUT.png]
K tenants each have their own long system prompt; requests are one tenant's system prompt plus a short question,
tenants in a seeded random order, sent at a fixed concurrency. Every policy gets the same requests in the same
order. Each replica's KV pool (--kv-blocks) holds only some tenants' prefixes, as a loaded replica's does: a
replica that sees every tenant evicts one tenant's prefix for the next's. Every request names its tenant as the
session (`x-session-id`, a header vllm-router reads); only `kv_aware+session` (kv_aware with
--kv-aware-session-affinity-ttl-secs) acts on it, placing a session's first request by its KV cost and keeping
the session on that replica while it is active. Reported per policy: the prefix-cache
hit rate in tokens (the replicas' vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total), TTFT p50
and p95 (from token arrivals at the client), throughput (requests/s, generated tokens/s), the requests each
replica served.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from client.metrics import scrape_many
from client.stream import Result, stream_openai
from perf.common import table
from scripts.cluster import Cluster

POLICIES = ("round_robin", "cache_aware", "kv_aware", "kv_aware+session")
VARIANTS = {"kv_aware+session": ("kv_aware", ["--kv-aware-session-affinity-ttl-secs", "60"])}   # name: policy, flags
WORDS = ("account invoice ledger policy tenant region cluster storage network backup billing quota release "
         "schedule contract support audit report metric alert").split()


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(1000 + tenant)
    return f"You are the assistant of tenant {tenant}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def workload(tenants: int, requests: int, words: int, seed: int = 0) -> list[tuple[int, str]]:
    """(tenant, prompt) in a seeded random order; each tenant asks requests / tenants questions."""
    rng = random.Random(seed)
    order = [t for t in range(tenants) for _ in range(requests // tenants)]
    rng.shuffle(order)
    systems = [system_prompt(t, words) for t in range(tenants)]
    return [(t, f"{systems[t]}\nQuestion {i}: what is the status of item {rng.randrange(10_000)}?\nAnswer:")
            for i, t in enumerate(order)]


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else values[0]


def counts(cluster: Cluster) -> list[tuple[float, float, float]]:
    """Each replica's prefix-cache hit and queried tokens, and the requests it finished."""
    return [(*scrape_many(f"{w.url}/metrics", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
             w.metric("vllm:request_success_total", finished_reason="length")) for w in cluster.workers]


def run_policy(policy: str, args, model: str, requests: list[tuple[int, str]]) -> dict:
    flags = ["--num-kv-blocks", str(args.kv_blocks), "--max-batch-size", "4", *args.engine_flags]
    router, router_flags = VARIANTS.get(policy, (policy, []))
    with Cluster(model, args.replicas, router, flags, [*router_flags, *args.router_flags],
                 kv_events=router == "kv_aware") as c:
        before = counts(c)
        url = c.url.removeprefix("http://")
        params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        results: list[Result | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=policy, unit="req", leave=False)

        def one(i: int) -> None:
            tenant, prompt = requests[i]
            results[i] = stream_openai(url, "pagoda", prompt, params, headers={"x-session-id": f"tenant-{tenant}"})
            bar.update()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, range(len(requests))))
        wall = time.perf_counter() - start
        bar.close()
        after = counts(c)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    ok = [r for r in results if r is not None and r.error is None and r.token_times]
    ttfts = [r.ttft for r in ok]
    return {"policy": policy, "hit_rate": hits / queries if queries else float("nan"), "hit_tokens": hits,
            "queried_tokens": queries, "ttft_p50_ms": 1000 * quantile(ttfts, 0.50),
            "ttft_p95_ms": 1000 * quantile(ttfts, 0.95), "requests_per_s": len(ok) / wall,
            "tokens_per_s": sum(len(r.token_times) for r in ok) / wall, "errors": len(requests) - len(ok),
            "served": [int(a[2] - b[2]) for a, b in zip(after, before)], "seconds": wall,
            "ttfts_ms": [1000 * t for t in ttfts]}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["policy"] for r in rows]
    left.bar(names, [100 * r["hit_rate"] for r in rows], color=["#999", "#4a7", "#37c", "#c73"][:len(rows)])
    left.set(title="prefix-cache hit rate (tokens)", ylabel="%")
    left.tick_params(axis="x", labelrotation=15)
    for r in rows:
        xs = sorted(r["ttfts_ms"])
        right.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["policy"])
    right.set(title="TTFT, cumulative", xlabel="ms", ylabel="fraction of requests", xscale="log")
    right.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.legend()
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=200, help="words of each tenant's system prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=128, help="each replica's KV pool, in blocks of 32")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--router-flag", dest="router_flags", action="append", default=[],
                    help="one more vllm-router flag or value (repeat)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("engine_flags", nargs="*", help="after --: more `engine serve` flags")
    args = ap.parse_args(argv)
    if args.model is None:
        from engine.models.presets import cached_model
        args.model = str(cached_model("small"))
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        ap.error(f"--policies: unknown policy {unknown[0]!r}; one of {', '.join(POLICIES)}")
    requests = workload(args.tenants, args.requests, args.system_words)
    rows = [run_policy(p, args, args.model, requests) for p in args.policies.split(",")]
    base = next((r for r in rows if r["policy"] == "round_robin"), None)
    print(f"{args.replicas} replicas, {args.tenants} tenants, {len(requests)} requests at concurrency "
          f"{args.concurrency}, {args.max_tokens} new tokens; KV pool {args.kv_blocks} blocks a replica")
    print(table(["policy", "hit rate", "x round_robin", "TTFT p50 ms", "TTFT p95 ms", "req/s", "tok/s", "served",
                 "errors"],
                [[r["policy"], f"{100 * r['hit_rate']:.1f}%",
                  f"{r['hit_rate'] / base['hit_rate']:.2f}" if base and base["hit_rate"] else "",
                  f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p95_ms']:.0f}", f"{r['requests_per_s']:.2f}",
                  f"{r['tokens_per_s']:.1f}", "/".join(map(str, r["served"])), r["errors"]] for r in rows]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
