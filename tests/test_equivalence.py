"""Greedy tokens are identical across {paged, dense} x {lookahead, sync} x {cold, hit} x {alone, batch of 4}."""
from __future__ import annotations

import itertools

import pytest

from engine import LLM
from tests.helpers import run_workload as run


@pytest.fixture
def reference(model_dir) -> list[list[int]]:
    llm = LLM(model=model_dir, kv_storage="paged", lookahead=False, prompt_cache=False, dtype="float32")
    ids, _ = run(llm, batch=False)
    return ids


@pytest.mark.parametrize("storage,lookahead,batch", list(itertools.product(["paged", "dense"], [True, False],
                                                                          [False, True])))
def test_greedy_tokens_identical(model_dir, reference, storage, lookahead, batch):
    llm = LLM(model=model_dir, kv_storage=storage, lookahead=lookahead, dtype="float32")
    cold, cold_cached = run(llm, batch)
    hit, hit_cached = run(llm, batch)
    assert cold_cached == [0, 0, 0, 0]
    assert all(c > 0 for c in hit_cached)          # the second pass really adopted cached KV
    assert cold == reference
    assert hit == reference
    assert llm.engine.lookahead.pipelined > 0 if lookahead else llm.engine.lookahead.pipelined == 0
