"""Continuous batching, chunked prefill, the bounded queue."""
from __future__ import annotations

from engine import LLM
from tests.helpers import greedy, random_ids


def test_batch_never_exceeds_max_and_refills(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_batch_size=2)
    eng = llm.engine
    reqs = [eng.add(eng.make_request(random_ids(20, seed=i), greedy(n))) for i, n in enumerate([5, 30, 10, 10])]
    widths, joined_while_running = [], False
    while eng.has_work:
        eng.step()
        widths.append(len(eng.scheduler.running))
        if reqs[2] in eng.scheduler.running and reqs[1] in eng.scheduler.running:
            joined_while_running = True
    assert max(widths) == 2
    assert joined_while_running          # request 2 took request 0's place while request 1 was decoding
    assert all(len(r.output_ids) == n for r, n in zip(reqs, [5, 30, 10, 10]))


def test_chunked_prefill(tiny_dir):
    prompt = random_ids(100, seed=3)
    whole = LLM(model=tiny_dir, dtype="float32").generate(prompt, greedy(10))[0].token_ids
    llm = LLM(model=tiny_dir, dtype="float32", prefill_chunk=32)
    eng = llm.engine
    req = eng.add(eng.make_request(prompt, greedy(10)))
    progress = []
    while req.prefilling or not req.output_ids:
        eng.step()
        progress.append(req.num_computed)
    assert progress[:4] == [32, 64, 96, 100]
    while eng.has_work:
        eng.step()
    assert req.output_ids == whole


def test_offline_generate_feeds_a_long_list_through_the_bounded_queue(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_queue=2)
    outs = llm.generate([random_ids(10, seed=i) for i in range(7)], greedy(3))
    assert [len(o.token_ids) for o in outs] == [3] * 7


def test_storage_choice(tiny_dir):
    assert LLM(model=tiny_dir, max_batch_size=4).engine.pool is not None
    assert LLM(model=tiny_dir, max_batch_size=1).engine.pool is None
    assert LLM(model=tiny_dir, max_batch_size=1, kv_storage="paged").engine.pool is not None
