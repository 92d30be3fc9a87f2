"""Run the real tritonserver shipped in the nvidia-pytriton wheel on this repo's model repository.

    python -m scripts.tritonserver [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                                   [--model-repository DIR] [-- extra tritonserver flags]
It assembles a Python backend folder holding the stub built for this interpreter's Python version, and a
small venv on Debian's python (whose libpython the stub embeds) that sees this interpreter's packages.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scripts.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent


def pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise SystemExit("tritonserver: nvidia-pytriton is not installed (pip install -e '.[triton]')")
    return Path(spec.origin).parent / "tritonserver"


def backend_dir(cache: Path) -> Path:
    """backends/python with libtriton_python.so, the utils module and the stub for this Python."""
    src = pytriton_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"tritonserver: no Python backend stub for Python {version}")
    dest = cache / "backends" / "python"
    dest.mkdir(parents=True, exist_ok=True)
    for f in [src / "backends/python/libtriton_python.so", src / "backends/python/triton_python_backend_utils.py",
              stub]:
        target = dest / f.name
        if not target.exists() or target.stat().st_size != f.stat().st_size:
            shutil.copy2(f, target)
    return dest.parent


CACHE = ROOT / ".cache" / "triton"


# explicit model control, every model loaded at start: lets the Python model unload itself when its engine is down
# for good (a crash loop), so Triton reports it not ready
CONTROL = ["--model-control-mode=explicit", "--load-model=*"]


def command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    backends = backend_dir(CACHE)
    return [str(pytriton_dir() / "bin" / "tritonserver"), f"--model-repository={args.model_repository}",
            f"--backend-directory={backends}", f"--http-port={args.http_port}", f"--grpc-port={args.grpc_port}",
            f"--metrics-port={args.metrics_port}", f"--http-address={args.host}", f"--grpc-address={args.host}",
            "--allow-metrics=true", "--log-info=true", *CONTROL, *extra]


def stub_env(cache: Path) -> Path:
    """A venv on Debian's python (the libpython the stub embeds), whose site-packages pulls in this
    interpreter's packages. The stub runs the first `python3` on PATH, so its stdlib then matches its libpython."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(f"/usr/bin/python{version}")
    if not base.exists():
        raise SystemExit(f"tritonserver: the backend stub needs Debian's python{version} "
                         f"(apt-get install python{version} python{version}-venv)")
    env_dir = cache / "stub-env"
    if not (env_dir / "bin" / "python3").exists():
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(env_dir)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([str(env_dir / "bin" / "python3"), "-c", purelib], text=True).strip())
    ours = sysconfig.get_paths()["purelib"]
    (site / "pagoda.pth").write_text(f"import site; site.addsitedir({ours!r})\n{ROOT}\n", encoding="utf-8")
    return env_dir / "bin"


def environment(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{stub_env(cache)}{os.pathsep}{env.get('PATH', '')}"
    libs = pytriton_dir().parent.parent / "nvidia_pytriton.libs"      # the stub's bundled CUDA runtime
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(libs), env.get("LD_LIBRARY_PATH", "")] if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONUTF8", "1")
    return env


@dataclass
class Server:
    proc: subprocess.Popen
    http: int
    grpc: int
    metrics: int
    log: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    def stop(self, timeout: float = 60) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout)


def launch(env: dict[str, str], log: Path, ready_timeout: float = 300,
           repository: Path = ROOT / "model_repository", exit_timeout: int = 15) -> Server:
    """Start tritonserver in the background on free loopback ports; returns once the model is ready and its metrics
    answer. `exit_timeout`: how long a stop waits for the model to unload (tritonserver's default is 30 s; 2.51
    sometimes never unloads a decoupled Python model after client cancellations, and then waits all of it)."""
    ports = free_ports(3)
    cmd = [sys.executable, "-m", "scripts.tritonserver", f"--http-port={ports[0]}", f"--grpc-port={ports[1]}",
           f"--metrics-port={ports[2]}", f"--model-repository={repository}", "--",
           f"--exit-timeout-secs={exit_timeout}"]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    server = Server(proc, *ports, log)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {proc.returncode}:\n{tail(log)}")
        try:       # the metrics service starts after HTTP's: a scrape right after ready may be refused
            if urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=2).status == 200 and \
                    urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/metrics", timeout=2).status == 200:
                return server
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tritonserver not ready in {ready_timeout}s:\n{tail(log)}")


def tail(log: Path) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-4000:]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", default=str(ROOT / "model_repository"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    cmd = command(ap.parse_args(own), extra)
    print(" ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, environment(CACHE))


if __name__ == "__main__":
    main()
