"""One greedy request through the engine in process, timed as the benchmarks time it."""
from __future__ import annotations

import time

from engine.core.engine import Engine
from engine.core.sampling import SamplingParams


def greedy_run(engine: Engine, prompt: str | list[int], max_tokens: int,
               lookahead: bool | None = None) -> tuple[float, float]:
    """(TTFT in seconds, decode tok/s = (tokens - 1) / (t_last - t_first)), EOS ignored. `lookahead` switches the
    engine's lookahead for this request (False: the PAGODA_FORCE_SYNC path); None leaves it as configured."""
    if lookahead is not None:
        engine.lookahead.enabled = lookahead
    start = time.perf_counter()
    engine.add(engine.make_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    times: list[float] = []
    while engine.has_work:
        for d in engine.step():
            times += [time.perf_counter()] * len(d.token_ids)
    return times[0] - start, (len(times) - 1) / (times[-1] - times[0])
