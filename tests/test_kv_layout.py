"""KV layer groups (engine/kv/layout.py) and what paged KV does with a sliding group: the blocks a sequence holds
stay within its window, a prompt-cache hit adopts the last window's blocks of each sliding group, and an engine
on a sliding-window model holds less KV per sequence than with one table for every layer, with the same tokens."""
from __future__ import annotations

import pytest

from engine import LLM
from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.kv.block_pool import BlockPool
from engine.kv.layout import Layout
from engine.kv.paged import PagedKV
from engine.kv.prefix_cache import PrefixCache
from engine.models.presets import cached_model
from tests.helpers import greedy, random_ids

BS = 16


def test_layers_group_by_window_in_groups_of_equal_size():
    gemma_270m = Layout.of(([512] * 5 + [0]) * 3)
    assert gemma_270m.width == 3 and gemma_270m.windows == (0,) + (512,) * 5
    assert [i for i, g in enumerate(gemma_270m.group) if g == 0] == [5, 11, 17]
    assert sorted(zip(gemma_270m.group, gemma_270m.slot)) == [(g, s) for g in range(6) for s in range(3)]
    assert Layout.of([48, 48, 0]) == Layout.of([48, 48, 0], hybrid=True)
    assert Layout.of([48, 48, 0]).windows == (0, 48, 48) and Layout.of([48, 48, 0]).width == 1
    assert Layout.of([40] * 4).windows == (40,) and Layout.of([40] * 4).slot == (0, 1, 2, 3)
    for windows in ([0, 0, 0], [48, 48, 0]):
        one = Layout.of(windows, hybrid=windows == [0, 0, 0])
        assert one.windows == (0,) and one.slot == (0, 1, 2) and one.width == 3


def kv(blocks: int = 64, windows: tuple[int, ...] = (0, 32), chunk: int = 0) -> PagedKV:
    cache = PrefixCache(BS)
    return PagedKV(BlockPool(blocks, BS, index=cache), cache, lambda src, dst: None, Layout.of(list(windows)), chunk)


def prefill(store: PagedKV, req: Request, admit: bool = True) -> list[int]:
    """Admit and prefill in the store's chunks; the blocks each group held at each step."""
    assert not admit or store.admit(req)
    held = []
    while req.prefilling:
        end = min(req.prefill_target, req.num_computed + (store.chunk or req.prefill_target))
        assert store.grow(req, end)
        held.append([len(t) - lo for t, lo in zip(req.tables, req.slid)])
        req.num_computed = req.num_allocated = end
        store.commit(req)
    return held


def test_a_long_prompt_takes_a_sliding_groups_blocks_chunk_by_chunk():
    store = kv(blocks=40, chunk=48)
    req = Request(0, random_ids(300, seed=7), SamplingParams(max_tokens=1))
    other = Request(1, random_ids(150, seed=8), SamplingParams(max_tokens=1))
    held = prefill(store, req)
    assert held[0] == [-(-300 // BS), 3] and max(h[1] for h in held) <= store.span(1, 300) < -(-300 // BS)
    assert not store.admit(other)          # 10 blocks for its full group, and its sliding one's reservation: no room
    store.release(req)
    assert store.pool.num_used == 0 and store.admit(other)


def test_a_prefill_under_way_keeps_what_admission_reserved():
    store = kv(blocks=40, chunk=48)
    first = Request(0, random_ids(200, seed=9), SamplingParams(max_tokens=1))
    assert store.admit(first)               # 13 full blocks, 3 sliding ones, and 8 - 3 more reserved
    assert store.pool.num_free == 40 - 13 - 3 and store.span(1, 200) == 8
    later = Request(1, random_ids(14 * BS, seed=10), SamplingParams(max_tokens=1))
    assert not store.admit(later)           # 14 + 3 + 5 blocks: 22 of the 24 free, but 5 of those are promised
    assert max(h[1] for h in prefill(store, first, admit=False)) <= 8
    store.release(first)
    assert store.admit(later)


def test_a_sliding_group_holds_its_window_and_a_block_more():
    store = kv()
    req = Request(0, random_ids(300, seed=1), SamplingParams(max_tokens=100))
    prefill(store, req)
    for _ in range(100):
        p = req.num_computed
        assert store.grow(req, p + 1)
        req.num_computed = req.num_allocated = p + 1
        store.commit(req)
    full, sliding = (len(t) - lo for t, lo in zip(req.tables, req.slid))
    assert full == -(-400 // BS)
    assert sliding <= -(-32 // BS) + 2 and req.slid[1] > 0
    assert store.held(req) == full + sliding
    store.release(req)
    assert store.pool.num_used == 0


def test_a_hit_takes_each_sliding_groups_last_window_of_the_shared_prefix():
    store = kv()
    prompt = random_ids(300, seed=2)
    first = Request(0, prompt, SamplingParams(max_tokens=1))
    prefill(store, first)
    kept = list(first.tables[1])
    store.release(first)
    # shares 200 tokens: its window's blocks were let go in the middle of the first prompt, and stay cached
    second = Request(1, prompt[:200] + random_ids(20, seed=3), SamplingParams(max_tokens=1))
    assert store.admit(second)
    n = second.num_computed
    assert n == 200 // BS * BS
    lo = second.slid[1]
    assert lo == (n - 32 + 1) // BS and second.tables[1][lo:n // BS] == kept[lo:n // BS]
    assert all(store.pool.ref[b] == 1 for b in second.tables[1][lo:])


def test_a_hit_is_cut_back_to_where_every_group_has_its_blocks():
    store = kv()
    prompt = random_ids(300, seed=4)
    first = Request(0, prompt, SamplingParams(max_tokens=1))
    prefill(store, first)
    last = first.tables[1][-2]                          # the sliding block of positions 272..287
    store.release(first)
    store.cache.forget(last)                           # as if evicted
    store.pool.cached.pop(last)
    second = Request(1, prompt + [5], SamplingParams(max_tokens=1))
    assert store.admit(second)
    assert second.num_computed == 17 * BS              # 18 blocks matched; the 18th's window lacks a block


def test_an_engine_on_a_sliding_model_holds_less_and_decodes_the_same(tmp_path):
    """tiny-gemma3: one full layer, two with a window of 48; a prompt of 200 and 40 tokens out."""
    model = str(cached_model("tiny-gemma3"))
    prompt = random_ids(200, seed=5)
    outs, held = [], []
    for hybrid in (True, False):
        llm = LLM(model=model, dtype="float32", block_size=BS, disable_hybrid_kv_cache_manager=not hybrid)
        engine = llm.engine
        kv_store = engine.kv
        seen = []
        engine_commit = kv_store.commit

        def commit(req, engine_commit=engine_commit, kv_store=kv_store, seen=seen):
            engine_commit(req)
            seen.append(kv_store.held(req) * kv_store.layout.width)       # layer-blocks held
        kv_store.commit = commit
        outs.append(llm.generate(prompt, greedy(40))[0].token_ids)
        held.append(seen[-1])
        again = llm.generate(prompt + outs[-1][:5], greedy(8))[0]
        assert again.cached_tokens > 0 and again.token_ids == outs[-1][5:13]
    assert outs[0] == outs[1]
    assert held[1] == 3 * -(-240 // BS)
    assert held[0] <= -(-240 // BS) + 2 * (-(-48 // BS) + 2)


@pytest.mark.parametrize("options", [{"attention": "reference"}, {"cuda_graphs": "true"}, {"runner": "mlx"}],
                         ids=["reference", "graphs", "mlx"])
def test_every_decode_path_reads_the_groups_tables(options):
    """The same tokens as one table for every layer, cold and after a hit, batched (tiny-gemma3, fp32; the
    compiled step: test_compiled_decode.py; Triton's: test_triton.py)."""
    if options.get("runner") == "mlx":
        pytest.importorskip("mlx.core")
    model = str(cached_model("tiny-gemma3"))
    prompts = [random_ids(n, seed=6 + n) for n in (150, 90)]
    options = {"dtype": "float32", **options}
    want = [o.token_ids for o in LLM(model=model, block_size=BS, disable_hybrid_kv_cache_manager=True,
                                     **options).generate(prompts, greedy(30))]
    llm = LLM(model=model, block_size=BS, **options)
    assert llm.engine.kv.layout.groups == 3
    for attempt in ("cold", "hit"):
        outs = llm.generate(prompts, greedy(30))
        assert [o.token_ids for o in outs] == want, attempt
        assert all(o.cached_tokens > 0 for o in outs) == (attempt == "hit")


def test_a_hit_adopts_every_groups_blocks_before_any_group_allocates():
    """With nothing free, the full group's fresh block evicts the least recently freed cached block, which must
    not be the sliding group's hit (found by hypothesis: it was, and both groups then wrote to it)."""
    cache = PrefixCache(BS)
    store = PagedKV(BlockPool(16, BS, contiguous=False, index=cache), cache, lambda src, dst: None,
                    Layout.of([0, 32]))
    prompt = random_ids(2 * BS + 1, seed=11)
    for i, ids in enumerate((prompt, random_ids(2 * BS + 1, seed=12))):    # 4 cached blocks each, prompt's first
        done = Request(i, ids, SamplingParams(max_tokens=1))
        prefill(store, done)
        store.release(done)
    assert store.admit(Request(2, random_ids(4 * BS, seed=13), SamplingParams(max_tokens=1)))
    assert store.pool.num_free == 0
    second = Request(3, prompt, SamplingParams(max_tokens=1))
    assert store.admit(second) and second.num_computed == 2 * BS
    held = [b for t, lo in zip(second.tables, second.slid) for b in t[lo:]]
    assert len(set(held)) == len(held) and all(store.pool.ref[b] == 1 for b in held)
    store.slots(second, 2 * BS, 2 * BS + 1)
    store.groups(second, 2 * BS, 2 * BS + 1)
