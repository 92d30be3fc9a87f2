"""Everything that needs a GPU, in one run: one JSON, one table, every section run whatever the others did.

    python -m perf.gpu_check [--dry-run] [--out DIR]      (perf/gpu_check.sh is the command to use)
Sections: the environment; the kernel tests compiled for the device; greedy identity in fp32 against the CPU
engine and transformers; bf16's first divergence from transformers; decode speed; the seed's hit-vs-miss
measurement; the decode-attention microbenchmark; the GGUF block GEMV's bandwidth; the device-memory share
(gpu_memory_utilization). Each records ok, its error and its seconds in the JSON, and the goals it measured go into
the table. --dry-run runs every section on the CPU on the tiny preset at tiny sizes (Triton through its
interpreter), so the script is tested where there is no GPU.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from perf.common import ROOT, table


@dataclass(slots=True, frozen=True)
class Sizes:
    device: str
    attention: str                # what the engine on the device runs
    presets: tuple[str, ...]      # greedy identity
    tokens: int                   # greedy tokens per identity request
    prompt: int                   # identity prompt length
    bf16_model: str
    bf16_tokens: int
    speed_model: str
    decode_tokens: int
    pairs: int
    seed_prompt: int              # the seed's 471-token prompts, 448 of them cached on a hit
    seed_tokens: int
    contexts: tuple[int, ...]     # attention microbenchmark
    batches: tuple[int, ...]
    iters: int
    blocks: int                   # num_kv_blocks of paged engines (0: sized by the engine)
    kernel_tests: str             # pytest -k of the kernel tests ("": all)
    speed_attention: str          # the speed sections' engines (the dry run: torch's ops, not interpreted Triton)
    quant_k: int                  # the block GEMV's weight: quant_k x quant_k
    lookaheads: tuple[bool, ...]  # greedy identity's lookahead settings per case (the dry run: the one a GPU runs)
    graphs: tuple[str, ...]       # greedy identity's paged cases' cuda_graphs (the dry run: the GPU's default path)
    max_len: int                  # greedy identity's max_model_len (0: the checkpoint's)


FULL = Sizes("cuda", "auto", ("tiny", "small", "tiny-gemma3", "tiny-mistral"), 32, 120, "qwen2.5-0.5b", 64,
             "qwen2.5-0.5b", 256, 3, 471, 512,
             (512, 2048, 8192), (1, 4), 50, 0, "", "auto", 4096, (True, False), ("true", "false"), 0)
DRY = Sizes("cpu", "triton", ("tiny-gemma3",), 4, 56, "tiny", 6, "tiny", 4, 1, 80, 4, (64,), (1,), 1, 16,
            "switch or buckets or mixed_parts or (sliding_window and 5-dtype0)", "reference", 256, (True,), ("true",),
            128)


def environment(s: Sizes) -> tuple[dict, list[dict]]:
    import torch
    versions = {}
    for name in ("torch", "triton", "transformers", "tokenizers", "safetensors"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env = {"python": platform.python_version(), "versions": versions, "device": s.device,
           "cuda": torch.version.cuda, "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if s.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env |= {"gpu": p.name, "memory_gib": round(p.total_memory / 2**30), "sms": p.multi_processor_count}
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError as e:
            env["driver"] = f"nvidia-smi: {e}"
    return env, []


def kernel_tests(s: Sizes) -> tuple[dict, list[dict]]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_kernels.py",
           "tests/test_graphs.py", "tests/test_triton_quant.py"]
    if s.kernel_tests:
        cmd += ["-k", s.kernel_tests]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = next((line.strip("= ") for line in reversed(done.stdout.splitlines())
                    if " passed" in line or " failed" in line or " error" in line), "no summary")
    if done.returncode != 0:
        raise RuntimeError(f"pytest: {summary}\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return {"summary": summary}, [{"name": "kernel tests on the device", "value": summary, "goal": "pass",
                                   "met": True}]


def memory_share(s: Sizes) -> tuple[dict, list[dict]]:
    """gpu_memory_utilization (vLLM's, from model.json): the engine, KV pool included, holds at most that share of
    the device. On a CPU there is no share to hold to: the runner reports no budget."""
    import torch

    from engine import LLM, SamplingParams
    from engine.models.presets import cached_model
    from engine.runners.torch.runner import TorchRunner
    share = 0.3
    if s.device != "cuda":
        runner = TorchRunner(str(cached_model(s.presets[0])), "float32", "cpu")
        budget = runner.kv_budget(share, 512)
        return {"budget": budget}, [{"name": "kv_budget on a CPU", "value": str(budget), "goal": "None",
                                     "met": budget is None}]
    llm = LLM(model=str(cached_model(s.speed_model)), device="cuda", gpu_memory_utilization=share)
    llm.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    total = torch.cuda.get_device_properties(0).total_memory
    held = torch.cuda.memory_reserved() / total
    blocks = llm.engine.pool.num_blocks
    del llm
    torch.cuda.empty_cache()
    return {"share": share, "held": round(held, 4), "blocks": blocks}, [
        {"name": f"device memory held at gpu_memory_utilization={share}", "value": f"{held:.3f}",
         "goal": f"<= {share}", "met": held <= share}]


def sections():
    from perf import gpu_correct, gpu_speed
    return {"environment": environment, "kernel tests": kernel_tests,
            "greedy identity (fp32)": gpu_correct.greedy_identity, "bf16 divergence": gpu_correct.bf16_divergence,
            "decode speed": gpu_speed.decode_speed, "hit vs miss (the seed)": gpu_speed.hit_miss,
            "decode attention": gpu_speed.attention, "block GEMV": gpu_speed.quant_gemv, "memory share": memory_share}


def distributions() -> list[str]:
    """The installed distributions whose modules this process imported (what the GPU machine must have)."""
    owners = importlib.metadata.packages_distributions()
    names = {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names)
    return sorted({d for n in names for d in owners.get(n, [])})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny preset, tiny sizes")
    ap.add_argument("--out", default=str(ROOT / "perf" / "results" / "gpu"))
    ap.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    args = ap.parse_args(argv)
    s = DRY if args.dry_run else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sizes": asdict(s),
                    "sections": {}, "goals": []}
    chosen = args.only.split(",") if args.only else None
    began = time.perf_counter()
    for name, fn in sections().items():
        if chosen and name not in chosen:
            continue
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        entry: dict = {"ok": False, "error": None}
        try:
            entry["results"], goals = fn(s)
            entry["ok"] = True
            report["goals"] += [{"section": name, **g} for g in goals]
        except Exception as e:                        # the next section runs whatever this one did
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"   failed: {entry['error']}", flush=True)
        entry["seconds"] = round(time.perf_counter() - t, 1)
        report["sections"][name] = entry
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))     # kept if killed
    report["seconds"] = round(time.perf_counter() - began, 1)
    report["distributions"] = distributions()
    text = render(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.txt").write_text(text + "\n")
    print(text)
    return report


def render(report: dict) -> str:
    env = report["sections"].get("environment", {}).get("results") or {}
    head = (f"gpu_check{' --dry-run (CPU, tiny)' if report['dry_run'] else ''} {report['date']}: "
            f"{env.get('gpu', env.get('device', '?'))}, driver {env.get('driver', '-')}, "
            f"torch {env.get('versions', {}).get('torch')}, triton {env.get('versions', {}).get('triton')}, "
            f"{report['seconds']:.0f} s")
    status = table(["section", "ok", "s", "error"],
                   [[n, "yes" if e["ok"] else "NO", f"{e['seconds']:.0f}", (e["error"] or "")[:90]]
                    for n, e in report["sections"].items()])
    met = {True: "yes", False: "NO", None: "-"}
    goals = table(["measured", "value", "goal", "met"],
                  [[g["name"], g["value"], g["goal"], met[g["met"]]] for g in report["goals"]])
    return f"{head}\n\n{status}\n\n{goals}"


if __name__ == "__main__":
    main()
