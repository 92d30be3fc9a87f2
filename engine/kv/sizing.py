"""How many KV blocks a paged pool gets when num_kv_blocks leaves it to the engine."""
from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.kv.layout import Layout
from engine.runners.base import ModelRunner

log = logging.getLogger("pagoda")


def pool_blocks(config: EngineConfig, runner: ModelRunner, max_model_len: int, layout: Layout) -> int:
    """With gpu_memory_utilization on a device that has a budget, as vLLM: all the share leaves. Else the fewer of
    what kv_cache_bytes holds and four full-length sequences per batch row (a block: one group's layers)."""
    per_block = runner.bytes_per_token * layout.width // len(layout.group) * config.block_size
    util = config.gpu_memory_utilization
    budget = runner.kv_budget(util, config.prefill_chunk) if util else None
    if budget is not None:
        if budget < per_block:
            raise ValueError(f"gpu_memory_utilization: {util} of the device leaves no room for KV blocks once the "
                             f"weights are loaded")
        return budget // per_block
    if util:
        log.info("pagoda: gpu_memory_utilization has no effect on this device; kv_cache_bytes bounds the KV pool")
    by_bytes = max(1, config.kv_cache_bytes // per_block)
    by_need = 4 * config.max_batch_size * layout.blocks(max_model_len, config.block_size, config.prefill_chunk)
    return min(by_bytes, by_need)
