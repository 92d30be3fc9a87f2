"""Admission: a request the queue cannot take is refused synchronously at submit, on both placements of the step
loop, with the seconds a client should wait; the measured drain rate sets that wait and the optional bound on the
estimated wait."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.admission import WINDOW_S, Admission, Overloaded
from engine.serving.client import make_client
from tests.helpers import greedy, random_ids, wait_until


def test_the_queue_bound_and_retry_after_follow_the_drain_rate():
    a = Admission(max_queue=3)
    a.check(2, now=0.0)
    with pytest.raises(Overloaded, match=r"queue: 3 requests waiting, the limit \(max_queue\)") as refused:
        a.check(3, now=0.0)
    assert refused.value.retry_after == 1                       # no rate measured yet: the shortest wait
    a.leave(4, now=10.0)
    a.leave(4, now=14.0)                                        # 8 requests in 4 s: 2 a second
    assert a.rate(14.0) == pytest.approx(2.0)
    assert a.retry_after(99, 14.0) == 50                        # 100 ahead at 2/s
    assert a.retry_after(999, 14.0) == 60 and a.retry_after(0, 14.0) == 1       # within [1, 60]
    assert a.rate(14.0 + WINDOW_S + 11) is None                 # the window forgets


def test_the_estimated_wait_bound():
    a = Admission(max_queue=100, max_queue_wait=5.0)
    a.check(50, now=0.0)                                        # no rate yet: nothing to estimate
    a.leave(2, now=0.0)
    a.leave(2, now=2.0)                                         # 2 a second
    a.check(9, now=2.0)                                         # 10 ahead: 5 s
    with pytest.raises(Overloaded, match=r"estimated wait \(5.5 s for 10 requests ahead\) exceeds max_queue_wait"):
        a.check(10, now=2.0)
    with pytest.raises(ValueError, match="max_queue_wait"):
        EngineConfig(max_queue_wait=-1)


@pytest.mark.parametrize("placement", ["thread", "process"])
def test_submit_refuses_what_the_queue_cannot_take(tiny_dir, placement):
    """One request decodes (max_batch_size 1) and two wait (max_queue 2): the next submit raises Overloaded and
    nothing reaches its push; the queued ones complete; then the queue takes requests again."""
    engine = make_client(EngineConfig(model=tiny_dir, dtype="float32", max_batch_size=1, max_queue=2,
                                      num_threads=1, engine_process=placement == "process"))
    try:
        ends: dict[int, str] = {}
        long = engine.submit(random_ids(12, seed=1), greedy(3000, ignore_eos=True),
                             lambda d: d.finished and ends.setdefault(d.request_id, d.finish_reason))
        wait_until(lambda: engine.metrics.value("pagoda_batch_size") == 1, "the first request to run")
        queued = [engine.submit(random_ids(12, seed=2 + i), greedy(3),
                                lambda d: d.finished and ends.setdefault(d.request_id, d.finish_reason))
                  for i in range(2)]
        pushed = []
        with pytest.raises(Overloaded, match="max_queue") as refused:
            engine.submit(random_ids(12, seed=9), greedy(3), pushed.append)
        assert refused.value.retry_after >= 1 and pushed == []
        engine.abort(long)
        wait_until(lambda: len(ends) == 3, "the running and queued requests to end")
        assert ends == {long: "abort", queued[0]: "length", queued[1]: "length"}
        again = []
        engine.submit(random_ids(12, seed=9), greedy(3), again.append)
        wait_until(lambda: again and again[-1].finished, "a request after the queue drained")
        assert again[-1].finish_reason == "length" and not pushed
    finally:
        engine.shutdown()
