"""Paged decode attention: time per call and achieved bandwidth, contiguous vs shuffled block tables.

    python -m perf.bench_attention [--impl reference|triton] [--device cuda] [--contexts 512,2048,8192] [--batches 1,4]
Bytes moved per call = the K and V of every sequence's context (what a kernel must read at least), so GB/s is
comparable with the device's memory bandwidth (--peak-gbs; known GPUs are looked up by name).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.kernels import select

PEAK_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008}


def peak_for(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_GBS.items() if k in name), None)


def setup(impl: str, device: torch.device, dtype: torch.dtype, batch: int, context: int, shuffled: bool,
          block_size: int = 32, kv_heads: int = 2, group: int = 7, head_dim: int = 64):
    """One decode-attention call over random caches, ready to time; returns (call, bytes of K/V it must read)."""
    ops = select(impl, device.type)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks) if shuffled else torch.arange(num_blocks)
    tables = order.view(batch, blocks_per_seq).to(device)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, kv_heads * group, head_dim, device=device, dtype=dtype)
    call = lambda: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, context)  # noqa: E731
    return call, 2 * batch * context * kv_heads * head_dim * k_cache.element_size()


def case(impl: str, device: torch.device, dtype: torch.dtype, batch: int, context: int, shuffled: bool,
         iters: int = 20) -> dict:
    call, moved = setup(impl, device, dtype, batch, context, shuffled)
    call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"impl": select(impl, device.type).name, "batch": batch, "context": context,
            "tables": "shuffled" if shuffled else "contiguous", "us": seconds * 1e6, "gbs": moved / seconds / 1e9}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="reference", choices=["reference", "triton"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    peak = args.peak_gbs or peak_for(device)
    rows = [case(args.impl, device, dtype, b, c, shuffled, iters=args.iters)
            for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))
            for shuffled in (False, True)]
    print(f"paged decode attention, {args.impl} on {device} {args.dtype}; 14 query heads over 2 KV heads, head dim 64"
          + (f"; peak {peak:.0f} GB/s" if peak else ""))
    print(f"{'batch':>5} {'context':>7} {'tables':>10} {'us':>9} {'GB/s':>8} {'% peak':>7} {'shuffled/contig':>15}")
    for i, r in enumerate(rows):
        ratio = f"{r['us'] / rows[i - 1]['us']:15.3f}" if r["tables"] == "shuffled" else ""
        pct = f"{100 * r['gbs'] / peak:7.1f}" if peak else f"{'':>7}"
        print(f"{r['batch']:>5} {r['context']:>7} {r['tables']:>10} {r['us']:9.1f} {r['gbs']:8.2f} {pct} {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_gbs": peak, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
