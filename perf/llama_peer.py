"""llama.cpp as a bench-peers peer: built on demand, fed the same checkpoint, run in its own process.

The registry has llama-cpp-python only as a source distribution, so `build()` compiles it (about 5-7 minutes on
2 cores) into a virtual environment of its own under the cache folder, once, with what the converter needs beside
it. The checkpoint is converted with the `convert_hf_to_gguf.py` that ships in that same sdist (vendor/llama.cpp,
with its own gguf-py), in that environment: its sentencepiece brings an OpenMP runtime of its own, which must not
load into a process beside torch's (tests/test_cpu_kernels.py). The GGUF files are cached beside it. `Peer` keeps
one model loaded in a worker (perf/llama_peer_worker.py) so that its runs and Pagoda's can alternate.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from engine.config import EngineConfig, cache_root
from engine.core.engine import Engine
from perf.common import Pair, decode_rate, greedy_run, median_pair, prompt_ids

VERSION = "0.3.36"
# what convert_hf_to_gguf.py imports (its requirements file pins older torch and transformers; these are the
# project's own, and the CPU build of torch)
CONVERTER = ["torch==2.13.0", "transformers==5.24.0", "sentencepiece", "safetensors", "pyyaml", "numpy"]
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}      # Pagoda's dtype -> the converter's --outtype
WORKER = Path(__file__).with_name("llama_peer_worker.py")
# llama.cpp's AMX kernels (built where -march=native has AMX) stop on an illegal instruction at their first batched
# matmul on the Intel Xeon VMs of this machine kind (tileloadd in its quantized GEMM, 2026-12-05), though AMX itself
# runs there (torch's oneDNN uses it): the build leaves them out and keeps every other native extension
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def home() -> Path:
    return cache_root() / "peers" / f"llama-cpp-python-{VERSION}"


def python() -> Path:
    return home() / "env" / "bin" / "python"


def _run(cmd: list, **kw) -> None:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed: {(done.stderr or done.stdout).strip()[-800:]}")


def build() -> tuple[Path | None, str]:
    """(the llama.cpp tree with the converter, "") once built and cached; (None, why) when it cannot be built."""
    done, src = home() / ".built-no-amx", home() / "src"
    tree = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if done.exists():
        return tree, ""
    try:
        src.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", "--clear", home() / "env"])
        _run([python(), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={VERSION}", "-d", src])
        sdist = src / f"llama_cpp_python-{VERSION}.tar.gz"
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
               "CMAKE_ARGS": f"-DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"}
        _run([python(), "-m", "pip", "install", "-q", "--no-cache-dir", sdist], env=env)
        _run([python(), "-m", "pip", "install", "-q", *CONVERTER])
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            wanted = [m for m in tar.getmembers() if m.name.startswith(prefix) and
                      m.name[len(prefix):].split("/")[0] in ("convert_hf_to_gguf.py", "conversion", "gguf-py")]
            tar.extractall(src, members=wanted, filter="data")
    except (OSError, RuntimeError) as e:
        return None, f"llama-cpp-python {VERSION} could not be built: {e}"
    done.touch()
    return tree, ""


def gguf(tree: Path, model: Path, dtype: str) -> Path:
    """The checkpoint at `model` as a GGUF of `dtype`'s type, converted by llama.cpp's own script once."""
    out = home() / "gguf" / f"{model.name}-{OUTTYPES[dtype]}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        _run([python(), tree / "convert_hf_to_gguf.py", model, "--outtype", OUTTYPES[dtype], "--outfile", tmp])
        tmp.rename(out)
    return out


# llama.cpp's file types (enum llama_ftype) of the quantizer's presets
FTYPES = {"q8_0": 7, "q5_0": 8, "q4_k_m": 15}
_QUANTIZE = """import ctypes, sys
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def quantized(tree: Path, model: Path, kind: str, threads: int = 2) -> Path:
    """The checkpoint as a GGUF in llama.cpp's `kind` preset (FTYPES): converted to bf16 by its script, then
    quantized by its own quantizer (llama_model_quantize), once."""
    out = home() / "gguf" / f"{model.name}-{kind}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".partial")
        _run([python(), "-c", _QUANTIZE, gguf(tree, model, "bfloat16"), tmp, FTYPES[kind], threads])
        tmp.rename(out)
    return out


class Peer:
    """One GGUF loaded by llama.cpp in a worker process, `threads` threads, greedy."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024) -> None:
        self.proc = subprocess.Popen([str(python()), str(WORKER), str(path), str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not self._read().get("ready"):
            raise RuntimeError("llama.cpp worker did not start")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
        """(TTFT in seconds, each token's arrival in seconds from the start) of one greedy run, EOS ignored."""
        got = self._ask(prompt, tokens)
        return got["ttft"], got["times"]

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        """The greedy token ids after `prompt`, EOS ignored."""
        return self._ask(prompt, tokens)["ids"]

    def _ask(self, prompt: list[int], tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def instruction_sets() -> str:
    """The x86 vector extensions llama.cpp's CPU backend is built with here ("avx2+avx512+avx512_bf16"...), as its
    llama_print_system_info names them; "?" where it cannot say."""
    info = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        done = subprocess.run([str(python()), "-c", info], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    on = [f.split("=")[0].strip().lower() for f in done.stdout.split("|") if f.strip().endswith("= 1")]
    return "+".join(n for n in on if n.startswith(("avx", "amx"))) or "?"


def compare(tree: Path, model: Path, dtype: str, threads: int, tokens: int, repeats: int,
            prefill: int = 512, file: Path | None = None, config: dict | None = None) -> tuple[Pair, Pair | None]:
    """Pagoda in process against llama.cpp on the same checkpoint, dtype and threads, in ABBA order, each side
    given the same prompts in turn (fresh ones, so neither reuses a cached prefix): (decode tok/s after a 64-token
    prompt, prefill tok/s = prefill / TTFT of a `prefill`-token prompt; None with prefill=0). With `file` (a GGUF),
    both read that file; `config`: more of Pagoda's EngineConfig (max_batch_size=1: dense KV)."""
    peer = Peer(file or gguf(tree, model, dtype), threads, n_ctx=max(prefill, 64 + tokens) + 16)
    engine = Engine(EngineConfig(model=str(file or model), dtype=dtype, num_threads=threads, **(config or {})))
    try:
        greedy_run(engine, prompt_ids(64, seed=1), 8), peer.run(prompt_ids(64, seed=1), 8)        # warm-up
        ours, theirs = itertools.count(10), itertools.count(10)
        decode = median_pair(lambda: greedy_run(engine, prompt_ids(64, seed=next(ours)), tokens)[1],
                             lambda: decode_rate(peer.run(prompt_ids(64, seed=next(theirs)), tokens)[1]), repeats)
        if not prefill:
            return decode, None
        ours, theirs = itertools.count(1000), itertools.count(1000)
        ttft = median_pair(lambda: prefill / greedy_run(engine, prompt_ids(prefill, seed=next(ours)), 1)[0],
                           lambda: prefill / peer.run(prompt_ids(prefill, seed=next(theirs)), 1)[0], repeats)
        return decode, ttft
    finally:
        peer.close()
