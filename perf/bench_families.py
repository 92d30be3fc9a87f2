"""bench-peers' families section: each family other than Qwen2 at its real geometry, bf16 decode, against
transformers generate and llama.cpp on its own conversion (perf/bench_peers.py runs it: `--only families`)."""
from __future__ import annotations

from engine.models.presets import cached_model
from perf import llama_peer

PRESETS = ("llama3.2-1b", "qwen3-0.6b", "gemma3-270m", "smollm2-135m")
QUICK = ("tiny-llama", "tiny-qwen3", "tiny-gemma3")


def rows(presets: tuple[str, ...], threads: int, tokens: int, repeats: int) -> list[dict]:
    """bf16 decode of each family preset: Pagoda / transformers, and Pagoda / llama.cpp where it converts it."""
    from perf.bench_peers import in_process, paired_row
    out = []
    tree, why = llama_peer.build()
    for preset in presets:
        out.append(paired_row("families vs transformers", f"{preset} bf16",
                               in_process(preset, "bfloat16", tokens, repeats, threads), "decode bf16"))
        if tree is None:
            print(f"llama.cpp family rows left out: {why}")
            continue
        try:
            decode, _ = llama_peer.compare(tree, cached_model(preset), "bfloat16", threads, tokens, repeats)
        except Exception as e:                  # a converter or loader refusal: the row is absent, said why
            print(f"llama.cpp {preset} row left out: {type(e).__name__}: ...{str(e)[-400:]}")
            continue
        out.append(paired_row("families vs llama.cpp", f"{preset} bf16 decode", decode, "llama.cpp bf16"))
    return out
