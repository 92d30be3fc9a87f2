"""The torch runner's attention dispatch: a sequence whose blocks form one run attends to a slice, no gather."""
from __future__ import annotations

import torch

from engine.kernels import reference, select
from engine.runners import torch_attention
from engine.runners.base import Row


def test_run_start_accepts_only_consecutive_block_ids():
    assert torch_attention.run_start([4, 5, 6, 9], 3) == 4
    assert torch_attention.run_start([4, 5, 6, 9], 4) == -1
    assert torch_attention.run_start([4, 6, 5], 3) == -1
    assert torch_attention.run_start([7], 1) == 7


def test_decode_over_a_run_matches_the_gather_path():
    torch.manual_seed(0)
    layers, blocks, bs, nkv, hd, nh = 2, 12, 8, 2, 16, 4
    k_cache, v_cache = torch.randn(layers, blocks, bs, nkv, hd), torch.randn(layers, blocks, bs, nkv, hd)
    start = 2 * bs + 3                                 # third block, fourth slot
    row = Row(0, start, [], prev=0, slots=[5 * bs + 3], block_table=[3, 4, 5])
    q, k, v = torch.randn(1, nh, hd), torch.randn(1, nkv, hd), torch.randn(1, nkv, hd)
    ops = select("reference", "cpu")
    k2, v2 = k_cache.clone(), v_cache.clone()
    got = torch_attention.paged(ops, k_cache, v_cache, [row], 0.25, torch.device("cpu"))(1, q, k, v)
    assert torch.equal(k_cache[1, 5, 3], k[0]) and torch.equal(v_cache[1, 5, 3], v[0])
    reference.write_kv(k2[1], v2[1], torch.tensor(row.slots), k, v)
    want = reference.paged_decode_attention(q, k2[1], v2[1], torch.tensor([row.block_table]),
                                            torch.tensor([start + 1]), 0.25)
    torch.testing.assert_close(got, want)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
