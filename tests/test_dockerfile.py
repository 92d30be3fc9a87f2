"""Dockerfile.tritonserver cannot be built here (no Docker engine): check what can be checked statically."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile.tritonserver").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_base_image_is_a_pinned_triton_release():
    base = [rest for op, rest in instructions() if op == "FROM"]
    assert len(base) == 1
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3", base[0])


def test_copied_files_exist():
    copies = [rest.split() for op, rest in instructions() if op == "COPY"]
    assert copies
    for args in copies:
        for src in args[:-1]:
            assert (ROOT / src).exists(), src


def test_gpu_override_ports_health_and_command():
    ops = instructions()
    run = " ".join(rest for op, rest in ops if op == "RUN")
    assert "KIND_GPU" in run and "configs/gpu.pbtxt" in run
    assert "kind: KIND_CPU" in (ROOT / "model_repository/llm/config.pbtxt").read_text()   # what the sed rewrites
    assert set(next(rest for op, rest in ops if op == "EXPOSE").split()) == {"8000", "8001", "8002"}
    assert "/v2/health/ready" in next(rest for op, rest in ops if op == "HEALTHCHECK")
    cmd = next(rest for op, rest in ops if op == "CMD")
    assert "tritonserver" in cmd and "--model-config-name=gpu" in cmd and "--model-repository=/models" in cmd
    assert "torch==2.13.0" in run
