"""Prefill's products over a GGUF file's blocks, by method: x rounded to int16 and VNNI's int16 products
(kernels/cpu_gemm16.h), and the weights dequantized a slice at a time into torch's GEMM in bf16 and in fp32. Every
projection of the file's layers (not the embedding or head, which prefill's rows do not multiply) times `rows`
random rows, the methods alternated within each repeat.

    python -m perf.bench_qgemm [--model FILE] [--rows 512] [--repeats 5] [--threads 2]

The model defaults to the registry's Gemma 3 270M. Prints each method's milliseconds for all the projections
(median and range of the repeats), its GMAC/s, and each method's time over int16's with the repeats' range (above
1: int16 is faster). A method this machine cannot run (int16 without AVX512-VNNI) is left out."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.kernels import cpu_build
from engine.models.quant import QLinear
from perf.common import cpu_model, table


def projections(engine: Engine) -> list[QLinear]:
    model = engine.runner.model
    head = model.head_weight
    return [m for m in model.modules() if isinstance(m, QLinear) and m is not head and m.kinds[0][4]]


def timed(fn, layers: list[QLinear], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for q in layers:
        fn(q, xs[q.shape[1]])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.model is None:
        from scripts.gemma3_270m import hf_dir
        args.model = str(next(hf_dir().parent.glob("*.gguf")))
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, num_threads=args.threads, max_model_len=64, num_kv_blocks=4))
    layers = projections(engine)
    if not layers:
        raise SystemExit(f"{args.model}: no packed quantized projections (kernels off, or a float file)")
    xs = {k: torch.randn(args.rows, k) for k in {q.shape[1] for q in layers}}
    methods = {"bf16": lambda q, x: q.sliced(x, torch.bfloat16), "fp32": lambda q, x: q.sliced(x, torch.float32)}
    probe = layers[0]
    if probe.kernel.gemm16(xs[probe.shape[1]][:40], probe.mat(), *probe.shape, probe.bias) is not None:
        methods = {"int16": lambda q, x: q.kernel.gemm16(x, q.mat(), *q.shape, q.bias), **methods}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for name, fn in methods.items():                                         # warm-up
        timed(fn, layers, xs)
    for r in range(args.repeats):
        for name in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
            times[name].append(timed(methods[name], layers, xs))
    macs = args.rows * sum(n * k for n, k in (q.shape for q in layers))
    rows = []
    for name, ts in times.items():
        row = [name, f"{1e3 * statistics.median(ts):.0f} ({1e3 * min(ts):.0f}-{1e3 * max(ts):.0f})",
               f"{macs / statistics.median(ts) / 1e9:.0f}"]
        if "int16" in times and name != "int16":
            ratios = [t / i for t, i in zip(ts, times["int16"])]
            row.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        elif "int16" in times:
            row.append("")
        rows.append(row)
    print(f"{args.model}: {len(layers)} projections x {args.rows} rows, {args.threads} threads; {cpu_model()}, "
          f"kernels {cpu_build.described()}")
    header = ["method", "ms (range)", "GMAC/s"] + (["over int16 (range)"] if "int16" in times else [])
    print(table(header, rows))
    return times


if __name__ == "__main__":
    main()
