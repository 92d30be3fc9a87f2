"""Run perf_analyzer from the tritonclient wheel with the CUDA runtime library it links, from its own wheel.

    python -m scripts.perf_analyzer -m llm -x 1 -u 127.0.0.1:8001 -i grpc --streaming --input-data FILE ...
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    exe = Path(sys.executable).parent / "perf_analyzer"
    if not exe.exists():
        found = shutil.which("perf_analyzer")
        if found is None:
            raise SystemExit("perf_analyzer: not installed (pip install -e '.[triton]')")
        exe = Path(found)
    import nvidia.cuda_runtime
    lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(lib), env.get("LD_LIBRARY_PATH", "")] if p)
    return [str(exe), *args], env


if __name__ == "__main__":
    cmd, env = command(sys.argv[1:])
    os.execve(cmd[0], cmd, env)
