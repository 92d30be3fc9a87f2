"""The CPU decode GEMV (cpu_gemv.cpp): built once per machine with the system C++ compiler, called through ctypes.

Eager torch reads fp32 weights at about half the memory bandwidth in a one-row F.linear; this kernel reads them at
close to it, and reads them once for up to MAX_ROWS rows. ctypes drops the GIL for the call, so other Python threads
(a server's responder) run while it streams the weights. PAGODA_CPU_GEMV=0 turns it off.
"""
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

log = logging.getLogger("pagoda")

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
MAX_ROWS = 8            # above this a step is a prefill chunk: torch's GEMM is faster there
MIN_WEIGHT = 32768      # smaller weights (the tiny preset's) stay on torch: the ctypes call costs more than it saves


class CpuGemv:
    """`gemv(x, weight, bias)` == F.linear(x, weight, bias) for contiguous fp32 CPU tensors, x of [m, k]."""

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        self.fn = lib.gemv_f32
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        self.fn.restype = None
        self.threads = threads

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        n, k = weight.shape
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        self.fn(x.data_ptr(), x.shape[0], weight.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), n, k, self.threads)
        return y

    max_rows = MAX_ROWS

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and weight.is_contiguous() and weight.numel() >= MIN_WEIGHT


def build_dir() -> Path:
    return Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda")) / "kernels"


def build() -> Path:
    """The shared library, compiled on first use into the cache folder under a name keyed by source and flags."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx})")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cxx, *FLAGS]).encode()).hexdigest()[:16]
    out = build_dir() / f"cpu_gemv-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    # rpath to torch's lib folder: the kernel's OpenMP calls land in the libgomp torch already loaded.
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [cxx, *FLAGS, str(SOURCE), "-o", tmp, f"-Wl,-rpath,{torch_lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, out)
    return out


def load(threads: int) -> CpuGemv | None:
    """The kernel for an x86 CPU with AVX2 and FMA, or None (turned off, other CPU, no compiler: torch serves)."""
    if os.environ.get("PAGODA_CPU_GEMV", "1").lower() in ("0", "false", "off"):
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        return CpuGemv(ctypes.CDLL(str(build())), threads)
    except (OSError, RuntimeError) as e:
        log.warning("CPU GEMV kernel unavailable, decode uses torch's F.linear: %s", e)
        return None
