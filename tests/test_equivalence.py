"""Greedy tokens are identical across {paged, dense} x {lookahead, sync} x {cold, hit} x {alone, batch of 4}."""
from __future__ import annotations

import itertools

import pytest

from engine import LLM, SamplingParams
from tests.conftest import random_ids

LENGTHS = [37, 70, 101, 140]
MAX_TOKENS = [24, 9, 30, 17]


def prompts() -> list[list[int]]:
    return [random_ids(n, seed=100 + i) for i, n in enumerate(LENGTHS)]


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]


def run(llm: LLM, batch: bool) -> tuple[list[list[int]], list[int]]:
    if batch:
        outs = llm.generate(prompts(), params())
    else:
        outs = [llm.generate(p, sp)[0] for p, sp in zip(prompts(), params())]
    return [o.token_ids for o in outs], [o.cached_tokens for o in outs]


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
