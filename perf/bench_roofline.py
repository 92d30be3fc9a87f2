"""bench-peers' roofline section: decode tok/s against what memory allows (read bandwidth over the weights' bytes)
and against one GEMV pass over every weight (perf/bench_peers.py runs it: `--only roofline`)."""
from __future__ import annotations

import statistics
import time

import torch

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.models import hugepages
from engine.models.presets import cached_model
from perf.common import Pair, greedy_run, paired, prompt_ids

SUM_BYTES = 1 << 30     # the bandwidth probe: more than any cache holds


def sum_bandwidth(x: torch.Tensor, reads: int = 5) -> float:
    """Read bandwidth in bytes/s: the median of `reads` sums over x (>= 1 GiB, so no cache holds it)."""
    times = []
    for _ in range(reads):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * x.element_size() / statistics.median(times)


def gemv_ceiling(engine: Engine, repeats: int = 5, linear=None) -> float:
    """tok/s if decode did nothing but one token's GEMV over every weight matrix once, with `linear` (default
    torch's own F.linear: the ceiling any torch-eager engine decodes under; or the engine's CPU GEMV kernel)."""
    linear = linear or torch.nn.functional.linear
    model = engine.runner.model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]   # lm_head too when untied
    if model.lm_head is None:
        weights.append(model.embed.weight)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    passes = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for w in weights:
                linear(xs[w.shape[1]], w)
            passes.append(time.perf_counter() - t)
    return 1 / statistics.median(passes[1:])


def rows(preset: str, threads: int, tokens: int, repeats: int) -> list[dict]:
    """Decode tok/s against what the memory system allows: read bandwidth / weight bytes per token (every weight
    read once), and against one GEMV pass over every weight. Each decode run sits between its own bandwidth and
    pass measurements, and each ratio is the median of the per-run ratios: the VM's bandwidth drifts within
    seconds, so many short runs (64 tokens, about 5 s on 0.5B) pair closer than a few long ones."""
    engine = Engine(EngineConfig(model=str(cached_model(preset)), dtype="float32", num_threads=threads))
    torch.set_num_threads(threads)
    # The probe reads a plain tensor and, as the engine's weights sit on 2 MiB pages, one on those too; the faster
    # of the two is the roofline, so the weights' page size cannot beat the ceiling they are measured against.
    probes = [torch.ones(SUM_BYTES // 4, dtype=torch.float32)]
    if hugepages.supported():
        probes.append(hugepages.empty(SUM_BYTES).view(torch.float32).fill_(1.0))
    for x in probes:
        x.sum()
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kernel = engine.runner.gemv
    greedy_run(engine, prompt_ids(), 8)
    rates, roofs, kernels, linears = [], [], [], []
    for _ in range(max(repeats, 3)):
        roofs.append(max(sum_bandwidth(x) for x in probes) / weights)
        rates.append(greedy_run(engine, prompt_ids(), tokens)[1])
        kernels.append(gemv_ceiling(engine, 3, kernel) if kernel is not None else float("nan"))
        linears.append(gemv_ceiling(engine, 3))

    from perf.bench_peers import paired_row

    def against(ceilings: list[float]) -> Pair:
        return paired(rates, ceilings)
    gb = weights / 1e9
    roof, k, lin = against(roofs), against(kernels), against(linears)
    return [paired_row("memory roofline", f"{preset} fp32 ({roof.peer * gb:.1f} GB/s)", roof, "roofline sum"),
            paired_row("memory roofline", f"GEMV kernel pass ({k.peer * gb:.1f} GB/s)", k, "roofline gemv"),
            paired_row("memory roofline", f"torch F.linear pass ({lin.peer * gb:.1f} GB/s)", lin,
                       "roofline linear")]
