"""A local cluster: N `python -m engine serve` replicas behind the vLLM project's router (`vllm-router`), on
loopback. Nothing here routes: the router does, with the policy it is given.

    python -m scripts.cluster [--replicas 2] [--policy cache_aware] [--port 30000] [--router-flag F ...]
        [-- ENGINE FLAGS]
prints the router's URL and serves until interrupted (`make cluster`). Tests and perf/bench_routing.py use
`Cluster` directly.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from client.metrics import scrape
from scripts.ports import free_ports

ROUTER = Path(sys.executable).with_name("vllm-router")
# Health checks each second, and a worker marked down after one failure: a dead replica leaves the rotation at
# once. Retries stay on (the router's default): a request refused by a dead replica is tried on another.
ROUTER_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--worker-startup-timeout-secs", "120"]


def get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def up(url: str) -> bool:
    try:
        get(url, timeout=1.0)
        return True
    except OSError:
        return False


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str                          # http://127.0.0.1:PORT
    log: Path
    kv_events: str | None = None      # its KV-event endpoint, when published

    def metric(self, name: str, **labels: str) -> float:
        """Its /metrics' samples of `name` with `labels`, summed (0 when absent)."""
        return scrape(f"{self.url}/metrics", name, **labels)


@dataclass
class Cluster:
    model: str
    replicas: int = 2
    policy: str = "cache_aware"
    engine_flags: list[str] = field(default_factory=list)
    router_flags: list[str] = field(default_factory=list)
    port: int = 0
    kv_events: bool = False           # replicas publish KV events; the router reads them (kv_aware)
    block_size: int = 32              # the replicas' KV block size, which the router's event index must share
    replica_flags: dict[int, list[str]] = field(default_factory=dict)     # more flags for replica i
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pagoda-cluster-")))
    workers: list[Replica] = field(default_factory=list)
    router: subprocess.Popen | None = None
    url: str = ""

    def start(self) -> Cluster:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Cluster:
        ports = free_ports(2 * self.replicas + 2)     # each replica's HTTP and KV events; the router's two
        for i in range(self.replicas):
            self.workers.append(self._replica(i, ports[2 * i], ports[2 * i + 1]))
        for w in self.workers:
            self._wait(w.proc, f"{w.url}/health", w.log)
        self.port = self.port or ports[-2]
        log = self.logs / "router.log"
        flags = ["--policy", self.policy, "--host", "127.0.0.1", "--port", str(self.port), *ROUTER_FLAGS,
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports[-1]),
                 "--worker-urls", *(w.url for w in self.workers)]
        if self.kv_events:
            flags += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", "pagoda"]
        for w in self.workers:
            if w.kv_events:
                flags += ["--kv-event-source", f"{w.url}={w.kv_events}"]
        self.router = subprocess.Popen([str(ROUTER), *flags, *self.router_flags], stdout=open(log, "w"),
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait(self.router, f"{self.url}/v1/models", log)
        return self

    def _replica(self, i: int, port: int, events_port: int) -> Replica:
        log = self.logs / f"replica{i}.log"
        flags = ["--model", self.model, "--port", str(port), "--served-model-name", "pagoda",
                 "--block-size", str(self.block_size), *self.engine_flags, *self.replica_flags.get(i, [])]
        events = None
        if self.kv_events:
            events = f"tcp://127.0.0.1:{events_port}"
            flags += ["--kv-events", "true", "--kv-events-endpoint", events.replace("127.0.0.1", "*")]
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", *flags], stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        return Replica(proc, f"http://127.0.0.1:{port}", log, events)

    @staticmethod
    def _wait(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not up(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill(self, i: int) -> None:
        """SIGKILL replica i and its engine process (a node lost)."""
        os.killpg(self.workers[i].proc.pid, signal.SIGKILL)
        self.workers[i].proc.wait()

    def stop(self) -> None:
        for proc in [self.router, *(w.proc for w in self.workers)]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [self.router, *(w.proc for w in self.workers)]:
            if proc is not None:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--kv-events", action="store_true", help="replicas publish KV events to the router")
    ap.add_argument("--router-flag", dest="router_flags", action="append", default=[],
                    help="one more vllm-router flag or value (repeat)")
    ap.add_argument("engine_flags", nargs="*", help="after --: more `engine serve` flags")
    args = ap.parse_args(argv)
    if args.model is None:
        from engine.models.presets import cached_model
        args.model = str(cached_model("small"))
    cluster = Cluster(args.model, args.replicas, args.policy, args.engine_flags, args.router_flags, port=args.port,
                      kv_events=args.kv_events)
    cluster.start()
    print(json.dumps({"router": cluster.url, "replicas": [w.url for w in cluster.workers],
                      "policy": args.policy, "logs": str(cluster.logs)}, indent=2))
    print(f"router on {cluster.url} (OpenAI API: {cluster.url}/v1); Ctrl-C stops the cluster", flush=True)
    try:
        while all(p.poll() is None for p in [cluster.router, *(w.proc for w in cluster.workers)]):
            time.sleep(1)
        print("a process of the cluster exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
