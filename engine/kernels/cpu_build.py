"""The CPU kernels (cpu_*.cpp): one shared library, built once per machine with the system C++ compiler into the
cache folder, loaded with ctypes. PAGODA_CPU_KERNELS=0 turns them off; torch's ops serve instead.

It is built for the instruction set torch found on this CPU: AVX2 + FMA, or with AVX-512 too, whose 512-bit loads
the GEMV uses (ATEN_CPU_CAPABILITY=avx2, torch's own switch, holds both to AVX2), and with AVX-512 the VNNI and BF16
extensions where the CPU has them."""
from __future__ import annotations

import ctypes
import functools
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

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_pointwise.cpp", "cpu_layers.cpp", "cpu_quant.cpp")]
HEADERS = [Path(__file__).with_name(name)
           for name in ("cpu_math.h", "cpu_blocks.h", "cpu_rows.h", "cpu_packed.h", "cpu_gemm16.h")]
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared"]
ISAS = {"avx2": ["-mavx2", "-mfma", "-mf16c"],
        "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]}


def isa() -> str | None:
    """avx512 | avx2 as torch's CPU capability says, or None (no AVX2: the kernels do not build)."""
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())


@functools.cache
def cpu_info(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("flags", "vendor_id"); empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags."""
    return frozenset(cpu_info("flags").split())


def ahead() -> int:
    """Bytes ahead of a weight stream that the GEMVs prefetch (the PAGODA_AHEAD macro), 0 for none. On the Intel
    Xeons of this machine kind a GEMV's stream read a third faster so (bf16), where a plain sum read as fast either
    way; on the AMD EPYCs, software prefetching read 0.76-0.99x (docs/cpu-kernels.md)."""
    return 4096 if cpu_info("vendor_id") == "GenuineIntel" else 0


def pair_rows() -> int:
    """Input rows from which the VNNI GEMV takes two groups of weight rows a pass in 512-bit vectors (the
    PAGODA_PAIR_ROWS macro). An AMD Zen 4 (family 25) splits a 512-bit operation into two 256-bit halves: there a
    decode step of 4 rows ran 1.14-1.19x faster on one group in 256-bit vectors, and from 5 rows the pairs were as
    fast or faster (docs/cpu-kernels.md)."""
    return 5 if cpu_info("vendor_id") == "AuthenticAMD" and cpu_info("cpu family") == "25" else 4


def vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (the block kernels' int8 dot products take it in the avx512 build)."""
    return "avx512_vnni" in cpu_flags()


def bf16() -> bool:
    """Whether this CPU has AVX512-BF16 (the bf16 GEMV's vdpbf16ps, in the avx512 build)."""
    return "avx512_bf16" in cpu_flags()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): torch's bf16 GEMM is fast there, and about
    five times slower than widening to fp32 elsewhere (models/widen.py)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def extensions(target: str) -> list[str]:
    """The AVX-512 extensions the `target` build takes on this CPU: vnni, bf16 (none for avx2)."""
    return [] if target != "avx512" else [name for name, has in (("vnni", vnni()), ("bf16", bf16())) if has]


def compile_flags(target: str, exts: list[str] | None = None) -> list[str]:
    """The compiler's flags for `target` with the AVX-512 extensions `exts` (default: this CPU's)."""
    return [*FLAGS, *ISAS[target], *(f"-mavx512{ext}" for ext in (extensions(target) if exts is None else exts)),
            f"-DPAGODA_AHEAD={ahead()}", f"-DPAGODA_PAIR_ROWS={pair_rows()}"]


def build(target: str = "avx2", exts: list[str] | None = None) -> Path:
    """The shared library for `target` (an ISAS key) with the AVX-512 extensions `exts` (default: this CPU's, see
    extensions), compiled on first use into the cache folder under a name keyed by source and flags."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx})")
    flags = compile_flags(target, exts)
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join([cxx, *flags]).encode())
    out = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        # one compiler per source, all at once, then one link
        objects = [Path(work) / f"{src.stem}.o" for src in SOURCES]
        running = [(cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                   for cmd in ([cxx, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objects))]
        for cmd, proc in running:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-500:]}")
        # rpath to torch's lib folder: the kernel's OpenMP calls land in the libgomp torch already loaded.
        torch_lib = Path(torch.__file__).parent / "lib"
        tmp = Path(work) / out.name
        cmd = [cxx, *flags, *map(str, objects), "-o", str(tmp), f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    return out


def bind(lib: ctypes.CDLL, name: str, argtypes: list, restype=None) -> ctypes._CFuncPtr:
    """The library's function `name`, typed (kernels return nothing: they write into their arguments)."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def library(target: str | None = None) -> ctypes.CDLL | None:
    """The kernels on an x86 CPU with AVX2 and FMA, built for `target` (default: this CPU's, see isa()), or None
    (turned off, other CPU, no compiler)."""
    target = target or isa()
    if not cpu_kernels() or target is None:
        return None
    try:
        return ctypes.CDLL(str(build(target)))          # dlopen of a loaded path returns the same handle
    except (OSError, RuntimeError) as e:
        log.warning("CPU kernels unavailable, torch's ops serve instead: %s", e)
        return None


def described(target: str | None = None) -> str:
    """The instruction sets the kernels are built for here, for a benchmark's line: "avx512+vnni+bf16", "avx2", or
    why there are none."""
    target = target or isa()
    if not cpu_kernels():
        return "none (PAGODA_CPU_KERNELS=0)"
    return "none (no AVX2)" if target is None else "+".join([target, *extensions(target)])
