"""KV held per sequence at 4k context, each family, with one block table for every layer (before) and with layer
groups whose sliding-window layers let go of what they cannot read again (after; engine/kv/layout.py).

Two measurements. The allocator's: a PagedKV over each model's layout takes one sequence through a 3968-token
prefill in 512-token chunks and 128 decode steps, as the engine drives it, and the blocks it holds are counted
(at the prefill's fullest step, and at 4096 positions). The engine's: a live engine on the gemma3-270m preset
(random weights, bf16) decodes the same shape, and the blocks its pool has in use at the last step are read.
Counts, not timings: the numbers are exact.

    python -m perf.bench_kv [--no-engine]
"""
from __future__ import annotations

import argparse

from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.kv.block_pool import BlockPool
from engine.kv.layout import Layout
from engine.kv.paged import PagedKV
from engine.kv.prefix_cache import PrefixCache
from engine.models.config import ModelConfig
from engine.models.presets import hf_config

BS, PROMPT, DECODE, CHUNK = 32, 3968, 128, 512
FAMILIES = ("qwen2.5-0.5b", "llama3.2-1b", "qwen3-0.6b", "smollm2-135m", "gemma3-270m")
# geometries of checkpoints without a preset here (their config.json's numbers)
MORE = {
    "gemma-3-1b": {**hf_config("gemma3-270m", [1], 2), "num_hidden_layers": 26, "head_dim": 256,
                   "num_key_value_heads": 1, "layer_types": ["full_attention" if (i + 1) % 6 == 0 else
                                                             "sliding_attention" for i in range(26)]},
    "mistral-7b-v0.1": {**hf_config("tiny-mistral", [2], 1), "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096},
}


def config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(MORE[name] if name in MORE else hf_config(name, [1], None))


def walk(cfg: ModelConfig, hybrid: bool) -> tuple[Layout, int, int]:
    """(layout, the most blocks held during the prefill, blocks held at PROMPT + DECODE positions) of one
    sequence."""
    layout = Layout.of(cfg.windows, hybrid)
    cache = PrefixCache(BS)
    blocks = layout.groups * (-(-(PROMPT + DECODE) // BS) + 1)
    kv = PagedKV(BlockPool(blocks, BS, index=cache), cache, lambda src, dst: None, layout, CHUNK)
    req = Request(0, list(range(PROMPT)), SamplingParams(max_tokens=DECODE))
    assert kv.admit(req)
    peak = 0
    while req.prefilling:
        end = min(req.num_computed + CHUNK, req.prefill_target)
        assert kv.grow(req, end)
        peak = max(peak, kv.held(req))
        req.num_computed = req.num_allocated = end
        kv.commit(req)
    for _ in range(DECODE):
        p = req.num_computed
        assert kv.grow(req, p + 1)
        req.num_computed = req.num_allocated = p + 1
        kv.commit(req)
    return layout, peak, kv.held(req)


def block_bytes(cfg: ModelConfig, layout: Layout, itemsize: int = 2) -> int:
    return 2 * layout.width * cfg.num_key_value_heads * cfg.head_dim * itemsize * BS


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def allocator_rows() -> None:
    print(f"KV held by one sequence at {PROMPT + DECODE} positions, bf16, block {BS}, the allocator's counts")
    print(f"{'model':<18} {'layers full/sliding':>20} {'window':>7} {'before MiB':>11} {'after MiB':>10} "
          f"{'after/before':>13} {'prefill peak MiB before/after':>30}")
    for name in (*FAMILIES, *MORE):
        cfg = config(name)
        one, peak0, before = walk(cfg, False)
        groups, peak, after = walk(cfg, True)
        sliding = sum(1 for w in cfg.windows if w)
        window = max(cfg.windows) or "-"
        b0, b1 = before * block_bytes(cfg, one), after * block_bytes(cfg, groups)
        peaks = f"{mib(peak0 * block_bytes(cfg, one))} / {mib(peak * block_bytes(cfg, groups))}"
        print(f"{name:<18} {f'{len(cfg.windows) - sliding}/{sliding}':>20} {window:>7} {mib(b0):>11} {mib(b1):>10} "
              f"{b1 / b0:>13.3f} {peaks:>30}")


def engine_rows(preset: str = "gemma3-270m") -> None:
    """The live engine: blocks in use at the sequence's last commit, each way."""
    from engine import LLM, SamplingParams
    from engine.models.presets import cached_model
    print(f"\n{preset} (random weights, bf16), one sequence, {PROMPT} + {DECODE} tokens, the engine's pool")
    print(f"{'tables':<28} {'blocks in use':>14} {'block KiB':>10} {'held MiB':>9}")
    for hybrid in (False, True):
        llm = LLM(model=str(cached_model(preset)), block_size=BS, max_batch_size=2, prefill_chunk=CHUNK,
                  disable_hybrid_kv_cache_manager=not hybrid, prompt_cache=False)
        kv, seen = llm.engine.kv, []
        commit = kv.commit
        kv.commit = lambda req: (commit(req), seen.append(kv.pool.num_used))
        llm.generate([list(range(7, 7 + PROMPT))], SamplingParams(max_tokens=DECODE, ignore_eos=True,
                                                                   temperature=0))
        cfg = ModelConfig.from_dir(cached_model(preset))
        size = block_bytes(cfg, kv.layout)
        label = "layer groups (default)" if hybrid else "one table (disable_hybrid...)"
        print(f"{label:<28} {seen[-1]:>14} {size / 1024:>10.0f} {mib(seen[-1] * size):>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-engine", action="store_true", help="the allocator's counts only")
    args = ap.parse_args()
    allocator_rows()
    if not args.no_engine:
        engine_rows()


if __name__ == "__main__":
    main()
