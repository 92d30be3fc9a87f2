"""bench-peers' GGUF section: Pagoda against llama.cpp on the same GGUF files (perf/bench_peers.py runs it: `--only
gguf`)."""
from __future__ import annotations

from pathlib import Path

from engine.models.presets import cached_model
from perf import llama_peer


def rows(preset: str, threads: int, tokens: int, repeats: int, kinds=("q8_0", "q4_k_m")) -> list[dict]:
    """Pagoda / llama.cpp on the same GGUF file, made from the preset by llama.cpp's converter and quantizer (and
    the registry's real Gemma 3 270M Q4_K_M where it can be had): decode and 512-token prefill. A goal is met when
    every pair meets it."""
    from perf.bench_peers import paired_row
    tree, why = llama_peer.build()
    if tree is None:
        print(f"GGUF rows left out: {why}")
        return []
    files = [(f"{preset} {kind}", llama_peer.quantized(tree, cached_model(preset), kind, threads)) for kind in kinds]
    try:
        from scripts.gemma3_270m import Unavailable, hf_dir
        files.append(("gemma-3-270m q4_k_m (real)", next(hf_dir().parent.glob("*.gguf"))))
    except (ImportError, Unavailable) as e:
        print(f"real Gemma 3 270M row left out: {e}")
    rows = []
    for name, file in files:
        decode, prefill = llama_peer.compare(tree, Path(file), "auto", threads, tokens, repeats, file=Path(file))
        size = Path(file).stat().st_size / 2**20
        rows += [paired_row("GGUF vs llama.cpp", f"{name} ({size:.0f} MiB) decode", decode, "gguf decode", True),
                 paired_row("GGUF vs llama.cpp", f"{name} 512-token prefill", prefill, "gguf prefill", True)]
    return rows
