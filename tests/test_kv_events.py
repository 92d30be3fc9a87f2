"""KV events (engine/kv/events.py, engine/serving/kv_publisher.py): what the prompt cache gains and loses, in the
order it happens, named by chain hashes that agree across replicas, on the wire as vllm-router decodes it, from a
publisher that never holds up a step; from both front ends' engines."""
from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.kv.events import Cleared, Removed, Stored, chain_hash
from engine.serving.kv_publisher import Publisher, encode
from scripts.ports import free_port
from tests.helpers import greedy, random_ids


def engine(model: str, **kw) -> Engine:
    e = Engine(EngineConfig(model=model, kv_storage="paged", block_size=16, dtype="float32", kv_events=True,
                            kv_events_endpoint=f"tcp://*:{free_port()}", **kw))
    e.on_delta = lambda d: None
    return e


def logged(e: Engine, prompt: list[int], n: int = 2) -> list:
    taken = []
    e.publish = lambda: taken.extend(e.kv_events.drain())        # the step's events, instead of publishing
    e.add(e.make_request(prompt, greedy(n)))
    while e.has_work:
        e.step()
    return taken


def test_blocks_are_stored_in_chains_and_removed_on_eviction(tiny_dir):
    e = engine(tiny_dir, num_kv_blocks=6)
    a = random_ids(40, seed=1)                      # two full blocks of 16
    first = logged(e, a)
    assert isinstance(first[0], Cleared)           # a fresh engine first says its cache is empty
    stored = first[1]
    assert isinstance(stored, Stored) and stored.parent is None and stored.tokens == a[:32]
    h0 = chain_hash(None, None, a[:16])
    assert stored.hashes == [h0, chain_hash(h0, None, a[16:32])]
    b = a[:32] + random_ids(20, seed=2)            # a hit on both, then one more full block of its own
    second = logged(e, b)
    assert [type(x) for x in second] == [Stored]
    assert second[0].parent == stored.hashes[1] and second[0].tokens == b[32:48]
    third = logged(e, random_ids(80, seed=3))      # five blocks: the pool of 6 must evict cached ones
    removed = [h for x in third if isinstance(x, Removed) for h in x.hashes]
    assert removed and set(removed) <= {*stored.hashes, *second[0].hashes}


def test_hashes_agree_across_replicas_and_differ_by_salt(tiny_dir):
    prompt = random_ids(40, seed=4)
    one, two = engine(tiny_dir), engine(tiny_dir)
    assert logged(one, prompt)[1].hashes == logged(two, prompt)[1].hashes
    h = chain_hash(None, None, prompt[:16])
    assert h != chain_hash(None, "tenant-b", prompt[:16]) and 0 <= h < 2 ** 63


def test_the_wire_format_is_what_vllm_router_decodes():
    payload = msgpack.unpackb(encode([Cleared(), Stored([7, 8], None, list(range(32))), Removed([7])], 16, 1.5))
    assert payload[0] == 1.5 and payload[2] == 0                 # [ts, events, data-parallel rank]
    cleared, stored, removed = payload[1]
    assert cleared == {"type": "AllBlocksCleared"}
    assert stored == {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
                      "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                      "lora_name": None}
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}


def test_a_subscriber_gets_numbered_batches_on_the_topic():
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    pub = Publisher(f"tcp://*:{port}", "kv@", 16)
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        got = []
        while len(got) < 3:                        # a SUB joins after its first messages: publish until heard
            pub.publish([Removed([len(got)])])
            if sub.poll(100):
                got.append(sub.recv_multipart())
        topics, seqs = {t for t, _, _ in got}, [int.from_bytes(s, "big") for _, s, _ in got]
        assert topics == {b"kv@"} and seqs == sorted(seqs) and len(set(seqs)) == 3
    finally:
        pub.close()
        sub.close(linger=0)


def test_a_stalled_publisher_drops_batches_instead_of_waiting(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(Publisher, "_run", lambda self: release.wait())     # the sender stuck: nothing drains
    pub = Publisher(f"tcp://*:{free_port()}", "", 16, max_batches=4)
    for i in range(10):
        pub.publish([Removed([i])])                # returns at once every time
    assert pub.queue.qsize() == 4 and pub.dropped == 6
    release.set()
    pub.close()


def test_an_endpoint_in_use_is_an_error_naming_the_option():
    port = free_port()
    first = Publisher(f"tcp://*:{port}", "", 16)
    try:
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            Publisher(f"tcp://*:{port}", "", 16)
    finally:
        first.close()


def test_kv_events_need_paged_kv_and_the_prompt_cache():
    with pytest.raises(ValueError, match="kv_events"):
        EngineConfig(kv_events=True, kv_storage="dense")
    with pytest.raises(ValueError, match="kv_events"):
        EngineConfig(kv_events=True, prompt_cache=False, kv_storage="paged")


def test_the_triton_models_engine_publishes_too(tiny_dir, monkeypatch):
    """config.pbtxt parameters turn events on for the Triton front end, whose engine runs in a child process."""
    from tests import test_triton_model as t
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    _, model = t.start_model(monkeypatch, {"model": tiny_dir, "dtype": "float32", "block_size": "16",
                                           "kv_events": "true", "kv_events_endpoint": f"tcp://*:{port}"})
    try:
        prompts, stored = [], []
        for attempt in range(20):                  # fresh prompts until the SUB has joined and heard a store
            prompts.append(random_ids(40, seed=9 + attempt))
            t.run(model, prompts[-1], 2)
            while sub.poll(200):
                batch = msgpack.unpackb(sub.recv_multipart()[2])
                stored += [ev for ev in batch[1] if ev["type"] == "BlockStored"]
            if stored:
                break
        assert stored and stored[0]["block_size"] == 16
        assert stored[0]["token_ids"] in [p[:32] for p in prompts]
    finally:
        model.finalize()
        sub.close(linger=0)


def test_a_hash_held_twice_is_announced_once_and_removed_with_its_last_holder():
    """An orphan (its parent evicted, the chain prefilled again) and its successor hold the same chain hash."""
    from engine.kv.events import BlockEvents
    from engine.kv.prefix_cache import PrefixCache, root
    events = BlockEvents()
    cache = PrefixCache(4, events)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    first = cache.register(0, root(None), a)
    cache.register(1, first, b)
    d0, d1 = events.drain()[0].hashes
    cache.forget(0)                                  # the parent goes first; block 1 is an orphan now
    assert [e.hashes for e in events.drain()] == [[d0]]
    again = cache.register(2, root(None), a)         # the prompt again: its chain registered anew
    cache.register(3, again, b)
    stored = events.drain()
    assert [(e.hashes, e.parent) for e in stored] == [([d0], None)]      # d1 is still held: not announced again
    cache.forget(1)                                  # the orphan's eviction leaves d1 with the new holder
    assert events.drain() == []
    cache.forget(3)
    assert [e.hashes for e in events.drain()] == [[d1]]


def test_a_prefills_blocks_are_announced_before_it_runs_and_taken_back_if_it_fails(tiny_dir):
    """As vLLM announces a block when it schedules it: a router hears of the prompt's blocks while they are being
    computed. A step that fails takes back what it announced."""
    e = engine(tiny_dir)
    published: list = []
    e.publish = lambda: published.extend(e.kv_events.drain())
    forward = e.runner.forward
    at_launch: list = []

    def watch(rows, prev):
        at_launch.append(list(published))
        return forward(rows, prev)
    e.runner.forward = watch
    prompt = random_ids(40, seed=5)
    e.add(e.make_request(prompt, greedy(2)))
    e.step()
    stored = [x for x in at_launch[0] if isinstance(x, Stored)]
    assert stored and stored[0].tokens == prompt[:32]                 # out before the prefill ran
    while e.has_work:
        e.step()
    assert sum(isinstance(x, Stored) for x in published) == 1          # registration kept the promise: no repeat

    def broken(rows, prev):
        raise RuntimeError("device lost")
    e.runner.forward = broken
    other = random_ids(40, seed=6)
    e.add(e.make_request(other, greedy(2)))
    with pytest.raises(RuntimeError):
        e.step()
    e.fail_all("device lost")
    e.publish()
    announced = [x for x in published if isinstance(x, Stored) and x.tokens == other[:32]]
    taken_back = [h for x in published if isinstance(x, Removed) for h in x.hashes]
    assert announced and set(announced[0].hashes) <= set(taken_back)
