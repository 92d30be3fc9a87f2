"""torch.compile'd paged decode (--compile): the same logits and tokens as the eager step, one graph for all steps."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.kernels import cpu_gemv, cpu_pointwise
from engine.kv.layout import Layout
from engine.models.presets import cached_model
from engine.runners.base import Row
from engine.runners.torch import attention as torch_attention
from engine.runners.torch.runner import TorchRunner
from tests.helpers import greedy, random_ids


@pytest.fixture(autouse=True)
def no_fused_layers(monkeypatch):
    """fp32 decode on the fused CPU kernels makes compile stand down (test_cpu_kernels); here the graph runs."""
    monkeypatch.setattr(cpu_pointwise, "load", lambda: None)



def one_group() -> tuple[int, Layout | None, list[Row]]:
    # two rows, tables with headroom past the blocks in use, one table shorter than the other
    return 16, None, [Row(0, 19, [5], slots=[4 * 8 + 3], block_table=[7, 2, 4, 9, 11]),
                      Row(1, 6, [9], slots=[3 * 8 + 6], block_table=[3])]


def sliding_groups() -> tuple[int, Layout | None, list[Row]]:
    """tiny-gemma3's layers: a full group and two with a window of 48; row 0 at position 60 slides."""
    tables = [[7, 2, 4, 9, 11, 12, 13, 14], [0, 15, 16, 17, 18, 19, 20, 21], [0, 22, 23, 24, 25, 26, 27, 28]]
    at = [([t[7] * 8 + 4], t) for t in tables]
    return 32, Layout.of([48, 48, 0]), [Row(0, 60, [5], slots=at[0][0], block_table=tables[0], groups=at[1:]),
                                        Row(1, 6, [9], slots=[3 * 8 + 6], block_table=[3],
                                            groups=[([29 * 8 + 6], [29]), ([30 * 8 + 6], [30])])]


@pytest.mark.parametrize("case", [one_group, sliding_groups])
def test_compiled_step_matches_eager_logits_and_writes_the_same_kv(odd_dir, case):
    model = odd_dir if case is one_group else str(cached_model("tiny-gemma3"))
    blocks, layout, rows = case()
    eager, compiled = (TorchRunner(model, "float32", "cpu", compile=c) for c in (False, True))
    for r in (eager, compiled):
        r.init_paged(blocks, 8, layout)
        torch.manual_seed(0)
        r.k_cache.normal_()
        r.v_cache.normal_()
    with torch.inference_mode():
        ids = torch.tensor([5, 9])
        got = compiled.compiled(ids, rows)
        attn = torch_attention.paged(eager.ops, eager.k_cache, eager.v_cache, rows, eager.scale, eager.device,
                                     eager.windows, eager.layout)
        want = eager.model.logits(eager.model(ids, torch.tensor([r.start for r in rows]), attn))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.k_cache, eager.k_cache)
    torch.testing.assert_close(compiled.v_cache, eager.v_cache)


def test_engine_with_compile_generates_what_eager_does(tiny_dir, monkeypatch):
    """Where the CPU GEMV loads, every projection goes to it as the torch op pagoda::gemv inside the graph (by
    default only weights over 2 MiB do; tiny has none); elsewhere the graph's own matmuls (as the step tests above
    compile them)."""
    gemv_op = cpu_gemv.load(threads=1) is not None
    if gemv_op:
        monkeypatch.setattr(cpu_gemv, "OP_MIN_BYTES", 0)
        monkeypatch.setattr(cpu_gemv, "MIN_WEIGHT", 0)
    prompts = [random_ids(40, seed=1), random_ids(70, seed=2)]
    compiled = LLM(model=tiny_dir, dtype="float32", kv_storage="paged", max_batch_size=2, compile=True)
    calls = []
    if gemv_op:
        kernel = cpu_gemv._OP_KERNEL
        monkeypatch.setattr(cpu_gemv, "_OP_KERNEL", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    eager = LLM(model=tiny_dir, dtype="float32", kv_storage="paged", max_batch_size=2)
    want = [o.token_ids for o in eager.generate(prompts, greedy(24))]
    assert [o.token_ids for o in compiled.generate(prompts, greedy(24))] == want        # batch of 2
    assert compiled.generate(prompts[0], greedy(24))[0].token_ids == want[0]            # then a batch of 1
    assert compiled.engine.pool.num_used == 0
    if gemv_op:
        assert len(calls) >= 2 * 23 * (4 * 2 + 1) and {1, 2} <= set(calls)    # 23 decode steps at batch 2, then 1
        assert max(calls) <= cpu_gemv.MAX_ROWS             # and the 8-token prefill after the prompt-cache hit


def test_compile_is_an_option_of_the_torch_runner_only():
    assert EngineConfig.from_sources({}, {"PAGODA_COMPILE": "true"}).compile
    with pytest.raises(ValueError, match="compile: only the torch runner"):
        EngineConfig(runner="mlx", compile=True)
