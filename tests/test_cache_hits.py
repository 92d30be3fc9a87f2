"""Adoption arithmetic: paged adopts whole blocks, dense adopts the common prefix; only the rest is prefilled."""
from __future__ import annotations

import re

import pytest

from engine import LLM, SamplingParams
from tests.helpers import random_ids

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prefilled(llm: LLM, prompt: list[int]) -> tuple[int, int]:
    """(cached_tokens, positions the runner computed during prefill) for one request."""
    runner = llm.engine.runner
    before = runner.tokens_computed
    out = llm.generate(prompt, GREEDY)[0]
    decode_positions = len(out.token_ids) - 1
    return out.cached_tokens, runner.tokens_computed - before - decode_positions


@pytest.mark.parametrize("storage,first_hit,repeat_hit", [("paged", 448, 448), ("dense", 460, 470)])
def test_471_token_prompt(tiny_dir, storage, first_hit, repeat_hit):
    llm = LLM(model=tiny_dir, kv_storage=storage, block_size=32, dtype="float32")
    earlier = random_ids(460, seed=7) + random_ids(5, seed=8)
    cached, computed = prefilled(llm, earlier)
    assert (cached, computed) == (0, 465)
    first_out = llm.generate(earlier, GREEDY)[0].token_ids[0]   # what would follow the earlier prompt
    tail = [t for t in random_ids(40, seed=9) if t != first_out and t != earlier[460]][:11]
    prompt = earlier[:460] + tail
    assert len(prompt) == 471
    assert prefilled(llm, prompt) == (first_hit, 471 - first_hit)
    assert prefilled(llm, prompt) == (repeat_hit, 471 - repeat_hit)


def test_block_hash_verified_against_tokens(tiny_dir):
    """A forged index entry whose stored tokens differ is not adopted."""
    llm = LLM(model=tiny_dir, kv_storage="paged", dtype="float32")
    prompt = random_ids(100, seed=1)
    llm.generate(prompt, GREEDY)
    cache = llm.engine.kv.cache
    block = cache.match(prompt)[0].block
    entry = cache.content[block]
    cache.content[block] = entry._replace(tokens=tuple(reversed(entry.tokens)))
    assert cache.match(prompt) == []
    assert llm.generate(prompt, GREEDY)[0].cached_tokens == 0


def test_prompt_cache_off(tiny_dir):
    for storage in ("paged", "dense"):
        llm = LLM(model=tiny_dir, kv_storage=storage, prompt_cache=False, dtype="float32")
        prompt = random_ids(80, seed=2)
        llm.generate(prompt, GREEDY)
        assert llm.generate(prompt, GREEDY)[0].cached_tokens == 0


def test_hit_metrics_and_log(tiny_dir, caplog):
    llm = LLM(model=tiny_dir, kv_storage="paged", dtype="float32")
    prompt = random_ids(100, seed=4)
    with caplog.at_level("INFO", logger="pagoda"):
        llm.generate(prompt, GREEDY)
        llm.generate(prompt, GREEDY)
    lines = [r.getMessage() for r in caplog.records if "request completed" in r.getMessage()]
    assert len(lines) == 2
    assert "prompt-cache: request completed cached=0/100" in lines[0]
    assert "cached=96/100" in lines[1]
    m = llm.engine.metrics
    assert m.value("pagoda_prompt_cache_queries_total") == 2
    assert m.value("pagoda_prompt_cache_hits_total") == 1
    assert m.value("pagoda_prompt_cache_cached_tokens_total") == 96
    assert m.value("pagoda_requests_total", status="completed") == 2
    # decode CPU: each line's per-token figure times its decoded tokens sums to the counter
    per_token = [float(re.search(r"decode_cpu=([\d.]+)ms/tok", line)[1]) for line in lines]
    outputs = [int(re.search(r"output=(\d+)", line)[1]) for line in lines]
    total = m.value("pagoda_decode_cpu_seconds_total")
    assert total > 0 and all(v > 0 for v in per_token)
    assert sum(v * (n - 1) for v, n in zip(per_token, outputs)) / 1000 == pytest.approx(total, rel=0.05, abs=2e-4)
