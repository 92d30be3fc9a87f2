"""CUDA-graph decode's fixed-shape step (engine/runners/torch/graphs.py), run uncaptured on the CPU: buckets,
padding into the scratch block, buffers reused in place, and the same tokens as the dynamic step through the
engine. Only the capture itself needs a GPU (perf/gpu_check.sh runs it)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.runners.base import Row
from engine.runners.torch import attention as torch_attention
from engine.runners.torch.graphs import buckets, plain
from engine.runners.torch.runner import TorchRunner
from tests.helpers import greedy, random_ids


def test_buckets_are_vllms_sizes_up_to_the_batch():
    assert buckets(1) == [1]
    assert buckets(4) == [1, 2, 4]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]


def runner(model_dir: str, graphs: str, blocks: int = 16, block_size: int = 8) -> TorchRunner:
    r = TorchRunner(model_dir, "float32", "cpu", attention="reference", cuda_graphs=graphs, max_batch_size=4)
    r.init_paged(blocks, block_size)
    torch.manual_seed(0)
    r.k_cache.normal_()
    r.v_cache.normal_()
    return r


ROWS = [Row(0, 19, [5], slots=[4 * 8 + 3], block_table=[7, 2, 4]),
        Row(1, 6, [9], slots=[3 * 8 + 6], block_table=[3]),
        Row(2, 0, [11], slots=[5 * 8], block_table=[5])]


def test_a_step_pads_to_its_bucket_into_the_scratch_block_and_matches_the_dynamic_step(tiny_dir):
    fixed, dynamic = runner(tiny_dir, "true"), runner(tiny_dir, "false")
    dynamic.k_cache.copy_(fixed.k_cache[:, :16])
    dynamic.v_cache.copy_(fixed.v_cache[:, :16])
    g = fixed.graphs
    assert fixed.k_cache.shape[1] == 17 and dynamic.k_cache.shape[1] == 16     # + one scratch block
    assert g.width == 16 and g.bucket(3) == 4 and g.bucket(1) == 1
    before = fixed.k_cache.clone()
    buffers = [t.data_ptr() for t in (g.ids, g.meta, g.tables)]
    with torch.inference_mode():
        ids = torch.tensor([5, 9, 11])
        logits, tokens = g.run(ROWS, ids)
        attn = torch_attention.paged(dynamic.ops, dynamic.k_cache, dynamic.v_cache, ROWS, dynamic.scale,
                                     dynamic.device)
        want = dynamic.model.logits(dynamic.model(ids, torch.tensor([19, 6, 0]), attn))
    assert logits.shape == (3, fixed.vocab_size) and torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # the fourth row is padding: position 0, length 1, the scratch block's first slot, a table of the scratch
    assert g.meta[:, 3].tolist() == [0, 1, 16 * 8] and g.tables[0, 3, 0] == 16
    assert g.meta[:, :3].tolist() == [[19, 6, 0], [20, 7, 1], [35, 30, 40]]
    assert g.tables[0, 0, :3].tolist() == [7, 2, 4] and g.tables[0, 1, :3].tolist() == [3, 16, 16]
    # K/V changed at the three rows' slots and the scratch's, nowhere else
    changed = (fixed.k_cache != before).flatten(3).any(-1).any(0).nonzero().tolist()
    assert changed == [[3, 6], [4, 3], [5, 0], [16, 0]]
    torch.testing.assert_close(fixed.k_cache[:, :16], dynamic.k_cache)
    with torch.inference_mode():
        g.run(ROWS[:1], ids[:1])
    assert [t.data_ptr() for t in (g.ids, g.meta, g.tables)] == buffers and g.replays == 2


def test_a_step_not_yet_sampled_keeps_its_logits_when_the_next_one_runs(tiny_dir):
    r = runner(tiny_dir, "true")
    first = r.forward(ROWS[:2], None)
    kept = first.logits.clone()
    r.forward([ROWS[2]], None)
    assert torch.equal(first.logits, kept)
    r.sample(first)
    assert r.fetch(first).tokens == kept.argmax(-1).tolist()


def test_rows_that_are_not_plain_greedy_are_sampled_from_the_graphs_logits():
    assert plain(Row(0, 0, [1])) and plain(Row(0, 0, [1], params=SamplingParams(temperature=0)))
    assert not plain(Row(0, 0, [1], params=SamplingParams(temperature=0.7)))
    assert not plain(Row(0, 0, [1], params=SamplingParams(temperature=0, presence_penalty=0.5)))
    assert not plain(Row(0, 0, [1], params=SamplingParams(temperature=0, logprobs=2)))
    assert not plain(Row(0, 0, [1], ban=(3,)))


PROMPTS = [random_ids(45, seed=1), random_ids(45, seed=1)[:40] + random_ids(9, seed=2), random_ids(20, seed=3),
           random_ids(70, seed=4)]


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "sync"])
def test_engine_with_graphs_generates_what_the_dynamic_step_does(tiny_dir, lookahead):
    """Cold, then a prompt-cache hit; a batch of four at different lengths that grows past block boundaries;
    seeded sampling, penalties and logprobs, which sample from the graph's logits."""
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=7, presence_penalty=0.3, logprobs=2,
                             ignore_eos=True)
    outs = {}
    for graphs in ("false", "true"):
        llm = LLM(model=tiny_dir, kv_storage="paged", dtype="float32", block_size=16, attention="reference",
                  cuda_graphs=graphs, lookahead=lookahead, max_batch_size=4)
        got = [llm.generate(PROMPTS[0], greedy(20))[0]]
        got += llm.generate(PROMPTS, greedy(40))
        got += llm.generate(PROMPTS[:3], sampled)
        assert got[2].cached_tokens == 32                         # the hit
        assert llm.engine.pool.num_used == 0                      # every block came back (the scratch is no block)
        replays = llm.engine.runner.graphs.replays if graphs == "true" else 0
        assert (replays > 0) == (graphs == "true")
        outs[graphs] = [(o.token_ids, [sorted(lp) for lp in o.logprobs or []]) for o in got]
    assert outs["true"] == outs["false"]


def test_tables_are_as_wide_as_the_longest_sequence_served(tiny_dir):
    """max_model_len below the checkpoint's narrows the fixed-shape tables, and with them the blocks a step reads."""
    wide = LLM(model=tiny_dir, kv_storage="paged", dtype="float32", block_size=16, cuda_graphs="true",
               num_kv_blocks=64, max_batch_size=2)
    narrow = LLM(model=tiny_dir, kv_storage="paged", dtype="float32", block_size=16, cuda_graphs="true",
                 num_kv_blocks=64, max_batch_size=2, max_model_len=40)
    assert wide.engine.runner.graphs.width == 64 and narrow.engine.runner.graphs.width == 3     # 40 tokens: 3 blocks
    assert narrow.engine.runner.max_model_len == narrow.engine.max_model_len == 40
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)          # 12 + 28: the whole context
    out = narrow.generate(PROMPTS[0][:12], params)[0]
    assert len(out.token_ids) == 28 and out.token_ids == wide.generate(PROMPTS[0][:12], params)[0].token_ids
    assert narrow.engine.runner.graphs.replays > 0 and narrow.engine.pool.num_used == 0


def test_cuda_graphs_option():
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="true", kv_storage="dense")
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="cuda_graphs: true and compile"):
        EngineConfig(cuda_graphs="true", compile=True)
    assert EngineConfig().cuda_graphs == "auto"


def test_auto_leaves_the_cpu_step_dynamic(tiny_dir):
    llm = LLM(model=tiny_dir, kv_storage="paged", dtype="float32")
    assert llm.engine.runner.graphs is None
    llm = LLM(model=tiny_dir, kv_storage="dense", dtype="float32", cuda_graphs="auto")
    assert llm.engine.runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a GPU (perf/gpu_check.sh)")
def test_captured_graphs_replay_what_the_dynamic_step_does_on_cuda(tiny_dir):
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=7, presence_penalty=0.3, ignore_eos=True)
    outs = {}
    for graphs in ("false", "true"):
        llm = LLM(model=tiny_dir, device="cuda", kv_storage="paged", dtype="float32", block_size=16,
                  cuda_graphs=graphs, max_batch_size=4)
        got = llm.generate(PROMPTS, greedy(40)) + llm.generate(PROMPTS[:2], sampled)
        if graphs == "true":
            g = llm.engine.runner.graphs
            assert sorted(g.graphs) == [1, 2, 4] and g.replays > 0
        outs[graphs] = [o.token_ids for o in got]
    assert outs["true"] == outs["false"]
