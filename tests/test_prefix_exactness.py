"""A prefix match is exact whatever the hash does, and cache_salt isolates tenants: requests with different salts
never share blocks or dense buffers."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv import prefix_cache
from tests.helpers import greedy, random_ids

PREFIXES = [random_ids(70, seed=s) for s in (1, 2)]


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing prefixes (whole blocks, and chains that part after a shared block), repeated."""
    tails = [random_ids(9 + i, seed=30 + i) for i in range(3)]
    prompts = [p + t for p in PREFIXES for t in tails] + [PREFIXES[0][:40] + PREFIXES[1][40:]]
    return prompts * 2, [greedy(12)] * (2 * len(prompts))


def run(tiny_dir, **options) -> tuple[list[list[int]], list[int]]:
    llm = LLM(model=tiny_dir, dtype="float32", block_size=16, **options)
    prompts, params = workload()
    outs = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    return [o.token_ids for o in outs], [o.cached_tokens for o in outs]


def test_every_block_hash_colliding_changes_nothing(tiny_dir, monkeypatch):
    want, hits = run(tiny_dir)
    baseline, _ = run(tiny_dir, prompt_cache=False)
    assert want == baseline and sum(hits) > 0
    monkeypatch.setattr(prefix_cache, "bucket", lambda parent, tokens: 0)       # every block in one bucket
    collided, collided_hits = run(tiny_dir)
    assert collided == want and collided_hits == hits
    assert collided_hits[6] == 32      # the chain that parts from PREFIXES[0] after 40 tokens: 2 blocks, not 4


def test_a_chain_is_matched_by_its_parents_not_only_its_tokens():
    cache = prefix_cache.PrefixCache(2)
    a = cache.register(0, prefix_cache.root(None), [1, 2])
    cache.register(1, a, [3, 4])
    b = cache.register(2, prefix_cache.root(None), [9, 9])
    assert [k.block for k in cache.match([9, 9, 3, 4])] == [2]       # [3, 4] is cached, but after [1, 2]
    cache.forget(0)                                                  # block 0 evicted, then reused
    cache.register(0, prefix_cache.root(None), [1, 2])
    assert [k.block for k in cache.match([1, 2, 3, 4])] == [0]       # the old child of block 0 is not taken
    assert b.block == 2


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_cache_salt_separates_tenants(tiny_dir, storage):
    llm = LLM(model=tiny_dir, dtype="float32", kv_storage=storage)
    prompt = random_ids(100, seed=5)

    def cached(salt):
        return llm.generate(prompt, greedy(4, cache_salt=salt))[0].cached_tokens
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0          # another salt, and no salt, share nothing
    assert cached("tenant-a") > 0 and cached("tenant-b") > 0 and cached(None) > 0     # each its own
    outs = {salt: llm.generate(prompt, greedy(8, cache_salt=salt))[0].token_ids for salt in ("tenant-a", None)}
    assert outs["tenant-a"] == outs[None]


def test_bad_cache_salt_names_the_field():
    for bad in (5, "", "x" * 257):
        with pytest.raises(ValueError, match="^cache_salt: must be a non-empty string of at most 256"):
            SamplingParams.from_dict({"cache_salt": bad})
