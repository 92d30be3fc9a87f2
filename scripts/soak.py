"""Soak: tritonserver with the default model under a mix of misses, hits, cancels at random points and bad inputs,
from N concurrent clients for a fixed time, loopback only, with `--kills` SIGKILLs of the engine process at random
times (each after the previous restart is done). Then it checks that nothing leaked and that a sample of greedy
outputs equals LLM.generate on the same model, and prints one summary. A request in flight at a kill ends with the
supervisor's error (lost to a restart) and one sent while the engine restarts is refused at once; both are counted,
neither is unexpected.

    python -m scripts.soak [--seconds 600] [--concurrency 8] [--max-requests 100000] [--kills 0] [--model DIR]
Exit status 1 when anything unexpected happened (an error, a stream without FINAL, a leaked block, a mismatch, a
kill that was not followed by a restart, a burst request that ended other than completed, refused before any token,
hung up or malformed).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from client.flood import BINS, burst_grpc
from client.metrics import scrape
from client.stream import grpc_inputs
from scripts.tritonserver import ROOT, launch

BAD = [  # (sampling parameters or inputs, the field the error must name)
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"seed": -1}, "seed"), ({"stop": 7}, "stop"), ({"max_tokenz": 3}, "max_tokenz"),
    ({"max_tokens": "lots"}, "max_tokens"), ("ids", "input_ids"), ("empty", "text_input"),
]


CANCELLED_MAX_TOKENS = 1000


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.prompts: list[list[int]] = []          # earlier MISS prompts, for HITs
        self.samples: list[tuple[list[int], list[int]]] = []   # (prompt, greedy output) to check offline
        self.errors: list[str] = []
        self.deadline = time.monotonic() + args.seconds

    def count(self, key: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if error and len(self.errors) < 10:
                self.errors.append(error)

    def stream(self, inputs: list, cancel_after: int | None = None) -> tuple[list[int], bool, Exception | None]:
        """(token ids, whether a FINAL response came, error) of one request; cancel_after k cancels after k
        responses (0: right after sending)."""
        import tritonclient.grpc as grpcclient
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        ids, final, error, cancelled = [], False, None, False
        try:
            client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
            while not final:
                if cancel_after is not None and len(ids) >= cancel_after:
                    client.stop_stream(cancel_requests=True)
                    cancelled = True
                    break
                result, error = events.get(timeout=self.args.request_timeout)
                if error is not None:
                    break
                response = result.get_response()
                out = result.as_numpy("output_ids")
                ids += [] if out is None else [int(i) for i in out]
                final = response.parameters["triton_final_response"].bool_param
        except queue.Empty:
            error = None                          # no FINAL in time
        finally:
            client.stop_stream()
            client.close()
        return ids, final or cancelled, error

    def restart_fault(self, kind: str, error: Exception | None) -> bool:
        """Count an error that a kill of the engine explains; False for any other."""
        text = str(error)
        if "restarting after the engine process exited" in text:
            self.count("refused while restarting")
            time.sleep(0.2)                       # a client backing off before it retries
        elif "the engine process exited" in text:
            self.count("lost to restarts")
        else:
            return False
        return True

    def one(self, rng: random.Random) -> None:
        kind = rng.choices(["miss", "hit", "cancel", "bad", "check"], weights=[3, 3, 2, 1, 1])[0]
        params = {"max_tokens": rng.randint(4, self.args.max_tokens), "temperature": 0, "ignore_eos": True}
        prompt = [rng.randrange(3, 900) for _ in range(rng.randint(20, self.args.prompt_tokens))]
        with self.lock:
            if kind == "hit" and self.prompts:
                earlier = rng.choice(self.prompts)
                prompt = earlier[:max(1, len(earlier) - rng.randint(1, 20))] + prompt[:rng.randint(1, 20)]
            elif kind == "miss":
                self.prompts = (self.prompts + [prompt])[-64:]
        self.count("sent")
        if kind == "bad":
            case, field = rng.choice(BAD)
            if case == "ids":
                inputs = grpc_inputs([5, 10 ** 6], params)
            elif case == "empty":
                inputs = grpc_inputs("", params)
            else:
                inputs = grpc_inputs("soak", {**params, **case})
            _, _, error = self.stream(inputs)
            if self.restart_fault(kind, error):
                return
            expected = error is not None and field in str(error)
            self.count("rejected as expected" if expected else "unexpected errors", None if expected else
                       f"bad input {case!r}: {error}")
            return
        cancel_after = None
        if kind == "cancel":
            # cancelled right after sending, before its first token: tritonserver 2.51's gRPC stream handler can
            # crash when a cancel arrives while a response is being sent (ModelStreamInferHandler::Process,
            # triton-inference-server/server#8034, fixed after 2.51 by server#8078), so a mid-stream cancel, which
            # a stream of a token a millisecond nearly always is, crashes it now and then. tests/test_triton.py
            # cancels one stream mid-way; this soak is about what many cancels leave behind.
            cancel_after = 0
            params["max_tokens"] = CANCELLED_MAX_TOKENS
        ids, final, error = self.stream(grpc_inputs(prompt, params), cancel_after)
        if error is not None and self.restart_fault(kind, error):
            return
        if error is not None:
            self.count("unexpected errors", f"{kind}: {error}")
        elif not final:
            self.count("responses without FINAL", f"{kind}: no FINAL within {self.args.request_timeout}s")
        elif cancel_after is not None and len(ids) < params["max_tokens"]:
            self.count("cancelled")
        else:
            self.count("completed")
            if len(ids) != params["max_tokens"]:
                self.count("unexpected errors", f"{kind}: {len(ids)} tokens, asked for {params['max_tokens']}")
            elif kind == "check":
                with self.lock:
                    self.samples.append((prompt, ids))

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            with self.lock:
                if self.counts["sent"] >= self.args.max_requests:
                    return
            self.one(rng)


def engine_pids(log: Path) -> list[int]:
    """The engine process's pids, in the order the server's log named them (the first, then each restart's)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    return [int(p) for p in re.findall(r"(?:step loop runs in process|engine restarted: process) (\d+)", text)]


def kill_engine(soak: Soak, log: Path, at: list[float], started: float) -> None:
    """SIGKILL the engine process at each of `at` (seconds into the soak), each once the previous one's restart
    is done (its new pid in the log)."""
    killed: set[int] = set()
    for when in at:
        while time.monotonic() < started + when or (engine_pids(log) or [0])[-1] in killed:
            if time.monotonic() > soak.deadline:
                return
            time.sleep(0.1)
        pid = engine_pids(log)[-1]
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
        soak.count("engine kills")


def wait_up(server, restarts: int, timeout: float = 120) -> None:
    """Until the server counts `restarts` restarts (the mirror copies the counter within a second)."""
    deadline = time.monotonic() + timeout
    while scrape(server.metrics_url, "pagoda_engine_restarts_total") < restarts and time.monotonic() < deadline:
        time.sleep(0.5)


def leaked_blocks(metrics_url: str, timeout: float = 30) -> float:
    """KV blocks still used once the server is idle (the gauges settle within a mirror period)."""
    deadline = time.monotonic() + timeout
    used = scrape(metrics_url, "pagoda_kv_blocks", state="used")
    while used and time.monotonic() < deadline:
        time.sleep(0.5)
        used = scrape(metrics_url, "pagoda_kv_blocks", state="used")
    return used


def check_samples(model: str | None, samples: list[tuple[list[int], list[int]]], limit: int) -> tuple[int, int]:
    """(checked, mismatched) greedy outputs against LLM.generate offline."""
    from engine import LLM, SamplingParams
    llm = LLM(model=model)
    mismatched = 0
    for prompt, ids in samples[:limit]:
        out = llm.generate(prompt, SamplingParams(max_tokens=len(ids), temperature=0, ignore_eos=True))[0]
        mismatched += out.token_ids != ids
    return min(limit, len(samples)), mismatched


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--check", type=int, default=8, help="greedy outputs to compare with LLM.generate")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded small model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=0, help="SIGKILLs of the engine process, at random times")
    ap.add_argument("--burst", type=int, default=0, help="then this many concurrent streams at once (a third hung "
                    "up, an eighth malformed), past what the queue holds (max_queue 64 here)")
    ap.add_argument("--log", default=str(ROOT / "perf/results/soak_tritonserver.log"))
    args = ap.parse_args(argv)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    env = {"PAGODA_NUM_KV_BLOCKS": "48", "PAGODA_MAX_BATCH_SIZE": "4", "PAGODA_MAX_QUEUE": "64",
           "PAGODA_RESTART_LIMIT": str(args.kills + 1)} | ({"PAGODA_MODEL": args.model} if args.model else {})
    log = Path(args.log)
    server = launch(env, log)
    started = time.monotonic()
    try:
        soak = Soak(server.grpc_url, args)
        threads = [threading.Thread(target=soak.worker, args=(args.seed * 1000 + i,)) for i in range(args.concurrency)]
        rng = random.Random(args.seed)
        at = sorted(rng.uniform(0.1, 0.8) * args.seconds for _ in range(args.kills))
        threads.append(threading.Thread(target=kill_engine, args=(soak, log, at, started)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if soak.counts["engine kills"]:                 # the last restart done before anything is counted
            wait_up(server, soak.counts["engine kills"])
        rng = random.Random(args.seed + 1)
        burst = burst_grpc(server.grpc_url, "llm", [[rng.randrange(1000) for _ in range(40)]
                                                     for _ in range(args.burst)], args.max_tokens)
        leaked = leaked_blocks(server.metrics_url)
        hits = scrape(server.metrics_url, "pagoda_prompt_cache_hits_total")
        restarts = scrape(server.metrics_url, "pagoda_engine_restarts_total")
    finally:
        server.stop()
    checked, mismatched = check_samples(args.model, soak.samples, args.check)
    c = soak.counts
    summary = {"seconds": round(time.monotonic() - started), "concurrency": args.concurrency, "sent": c["sent"],
               "completed": c["completed"], "cancelled": c["cancelled"],
               "rejected as expected": c["rejected as expected"], "unexpected errors": c["unexpected errors"],
               "responses without FINAL": c["responses without FINAL"], "engine kills": c["engine kills"],
               "restarts": restarts, "lost to restarts": c["lost to restarts"],
               "refused while restarting": c["refused while restarting"], "leaked blocks": leaked,
               "prompt-cache hits": hits, "greedy outputs checked": checked, "greedy mismatches": mismatched,
               "burst": args.burst, **{f"burst {b}": burst[b] for b in BINS},
               "burst unexpected": sum(n for b, n in burst.items() if b not in BINS),
               "first errors": soak.errors + [b for b in burst if b not in BINS][:5]}
    print("soak summary\n" + "\n".join(f"  {k:26} {v}" for k, v in summary.items() if k != "first errors"))
    for e in soak.errors:
        print(f"  error: {e}")
    summary["ok"] = not (c["unexpected errors"] or c["responses without FINAL"] or leaked or mismatched
                         or restarts != c["engine kills"] or summary["burst unexpected"])
    print(json.dumps({"ok": summary["ok"]}))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
