"""Replicas behind the vLLM project's router (vllm-router), on loopback, on the tiny model: streaming through it,
a client that disconnects through it frees the replica's blocks, and a replica killed mid-run is routed around
(only the requests in flight there fail)."""
from __future__ import annotations

import http.client
import json
import threading

import pytest

from scripts.cluster import ROUTER, Cluster
from tests.helpers import random_ids, wait_until

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (make setup installs it)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from engine.models.presets import make_model
    model = make_model("tiny", tmp_path_factory.mktemp("router-tiny"))
    with Cluster(str(model), replicas=2, policy="round_robin",
                 engine_flags=["--dtype", "float32", "--max-batch-size", "4"]) as c:
        yield c


def stream(url: str, prompt: list[int], max_tokens: int, stop_after: int | None = None) -> tuple[list[dict], str]:
    """POST a streaming completion; the chunks read and how the stream ended ("done", "closed" by us, or the
    error)."""
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=60)
    body = {"model": "pagoda", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    chunks: list[dict] = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return chunks, f"status {resp.status}: {resp.read()[:200]!r}"
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks, "done"
            chunks.append(json.loads(line[6:]))
            if stop_after is not None and len(chunks) >= stop_after:
                return chunks, "closed"
        return chunks, "ended without [DONE]"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return chunks, f"error: {type(e).__name__}: {e}"
    finally:
        conn.close()


def tokens(chunks: list[dict]) -> int:
    return sum(len(c["choices"][0].get("token_ids") or []) for c in chunks if c.get("choices"))


def test_streams_through_the_router_to_every_replica(cluster):
    before = [w.metric("vllm:request_success_total", finished_reason="length") for w in cluster.workers]
    for i in range(4):
        chunks, end = stream(cluster.url, random_ids(40, seed=i), 8)
        assert end == "done" and tokens(chunks) == 8
    after = [w.metric("vllm:request_success_total", finished_reason="length") for w in cluster.workers]
    assert [a - b for a, b in zip(after, before)] == [2, 2]         # round robin: two each


def test_a_client_disconnect_through_the_router_frees_the_replicas_blocks(cluster):
    cancelled = [w.metric("pagoda_requests_total", status="cancelled") for w in cluster.workers]
    chunks, end = stream(cluster.url, random_ids(70, seed=50), 4000, stop_after=2)
    assert end == "closed" and chunks
    wait_until(lambda: sum(w.metric("pagoda_requests_total", status="cancelled") for w in cluster.workers)
               == sum(cancelled) + 1, "the replica to abort the request", timeout=30)
    for w in cluster.workers:
        wait_until(lambda: w.metric("pagoda_kv_blocks", state="used") == 0, f"{w.url} to free its blocks")


def test_a_killed_replica_fails_only_its_requests_in_flight(cluster):
    """Last in this module: it kills a replica."""
    results: dict[int, tuple[list[dict], str]] = {}
    running = [w.metric("vllm:num_requests_running") for w in cluster.workers]
    assert running == [0, 0]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(cluster.url, random_ids(30, i),
                                                                                   3000)))
               for i in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: [w.metric("vllm:num_requests_running") for w in cluster.workers] == [1, 1],
               "a stream running on each replica", timeout=30)
    cluster.kill(0)
    for t in threads:
        t.join(timeout=120)
    ends = sorted(end for _, end in results.values())
    assert "done" in ends and ends.count("done") == 1, ends     # the survivor's stream finishes
    broken = next(end for _, end in results.values() if end != "done")
    assert broken != "closed", broken                            # the other one ends in an error, not silently
    for i in range(4):                                           # new requests all go to the survivor
        chunks, end = stream(cluster.url, random_ids(20, seed=90 + i), 4)
        assert end == "done" and tokens(chunks) == 4, end


def test_kv_aware_routes_a_shared_prefix_to_the_replica_that_holds_it(tmp_path):
    """The replicas publish KV events; the router's kv_aware policy renders each request's tokens on a replica
    (/v1/completions/render) and sends it where its prefix's blocks are. Round robin would alternate."""
    from engine.models.presets import make_model
    model = make_model("tiny", tmp_path / "tiny")
    with Cluster(str(model), replicas=2, policy="kv_aware", kv_events=True, block_size=16,
                 engine_flags=["--dtype", "float32"]) as c:
        system = random_ids(96, seed=77)                  # six blocks every request shares
        for i in range(6):
            chunks, end = stream(c.url, system + random_ids(5, seed=200 + i), 2)
            assert end == "done", end
        served = [w.metric("vllm:request_success_total", finished_reason="length") for w in c.workers]
        hits = [w.metric("vllm:prefix_cache_hits_total") for w in c.workers]
        assert sorted(served) == [0, 6], served                       # all six on one replica
        assert max(hits) == 5 * 96                                    # and every one after the first hit


def test_requests_a_saturated_replica_refuses_are_retried_on_the_other(tmp_path):
    """Replica 0 takes one request and queues one (max_queue 1): two long ones sent to it directly fill it; a burst
    through the router then finds it full, it answers 429 before any byte, and the router retries those on replica
    1: the client sees no failure. Round robin picks a retry's replica as it picks any request's, so a retry can
    land on replica 0 again; the router's default five tries left one request of twelve refused in one suite run
    of many, so it gets twenty here, at most 100 ms apart."""
    from engine.models.presets import make_model
    model = make_model("tiny", tmp_path / "tiny")
    with Cluster(str(model), replicas=2, policy="round_robin", engine_flags=["--dtype", "float32"],
                 router_flags=["--retry-max-retries", "20", "--retry-max-backoff-ms", "100"],
                 replica_flags={0: ["--max-batch-size", "1", "--max-queue", "1"],
                                1: ["--max-batch-size", "4", "--max-queue", "64"]}) as c:
        full = c.workers[0]
        hogs: dict[int, tuple[list[dict], str]] = {}
        holders = [threading.Thread(target=lambda i=i: hogs.__setitem__(i, stream(full.url, random_ids(30, 100 + i),
                                                                                  3000)))
                   for i in range(2)]
        for t in holders:
            t.start()
        wait_until(lambda: full.metric("vllm:num_requests_running") >= 1 and
                   full.metric("vllm:num_requests_waiting") >= 1, "replica 0 to be full")
        results: dict[int, tuple[list[dict], str]] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(c.url, random_ids(30, 200 + i),
                                                                                       64)))
                   for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(end for _, end in results.values()) == ["done"] * 12, results
        assert all(tokens(chunks) == 64 for chunks, _ in results.values())
        for t in holders:
            t.join(timeout=120)
        assert [end for _, end in hogs.values()] == ["done"] * 2, hogs
        wait_until(lambda: c.workers[0].metric("pagoda_requests_total", status="refused") > 0,
                   "replica 0 to count its refusals", timeout=30)
