"""The CPU kernels (cpu_*.cpp): one shared library, built once per machine with the system C++ compiler into the
cache folder, loaded with ctypes. PAGODA_CPU_KERNELS=0 turns them off; torch's ops serve instead."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.config import cache_root, cpu_kernels

log = logging.getLogger("pagoda")

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_pointwise.cpp")]
HEADERS = [Path(__file__).with_name("cpu_math.h")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]


def build() -> Path:
    """The shared library, compiled on first use into the cache folder under a name keyed by source and flags."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx})")
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join([cxx, *FLAGS]).encode())
    out = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    # rpath to torch's lib folder: the kernel's OpenMP calls land in the libgomp torch already loaded.
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [cxx, *FLAGS, *map(str, SOURCES), "-o", tmp, f"-Wl,-rpath,{torch_lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, out)
    return out


def library() -> ctypes.CDLL | None:
    """The kernels on an x86 CPU with AVX2 and FMA, or None (turned off, other CPU, no compiler)."""
    if not cpu_kernels():
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        return ctypes.CDLL(str(build()))          # dlopen of a loaded path returns the same handle
    except (OSError, RuntimeError) as e:
        log.warning("CPU kernels unavailable, torch's ops serve instead: %s", e)
        return None
