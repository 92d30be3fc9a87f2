"""bench-peers' GGUF section: Pagoda against llama.cpp on the same GGUF files (perf/bench_peers.py runs it: `--only
gguf`)."""
from __future__ import annotations

from pathlib import Path

from engine.models.presets import cached_model
from perf import llama_peer
from perf.common import prompt_ids

FILES = (("qwen2.5-0.5b", "q8_0"), ("qwen2.5-0.5b", "q4_k_m"), ("llama3.2-1b", "q4_k_m"), ("qwen3-0.6b", "q4_k_m"))
QUICK = (("tiny-qwen", "q8_0"), ("tiny-qwen", "q4_k_m"))


def rows(files: tuple[tuple[str, str], ...], threads: int, tokens: int, repeats: int) -> list[dict]:
    """Pagoda / llama.cpp on the same GGUF file, made from a preset (one per family llama.cpp converts) by
    llama.cpp's converter and quantizer, and the registry's real Gemma 3 270M Q4_K_M where it can be had: decode and
    512-token prefill, each engine's greedy agreement with transformers, and Pagoda's resident memory. A goal is
    met when every pair meets it."""
    from perf.bench_peers import labelled, paired_row
    tree, why = llama_peer.build()
    if tree is None:
        print(f"GGUF rows left out: {why}")
        return []
    files = [(f"{preset} {kind}", llama_peer.quantized(tree, cached_model(preset), kind, threads))
             for preset, kind in files]
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
        agreement(Path(file), threads)
        print(resident(Path(file), threads))
    return labelled(rows)


def agreement(file: Path, threads: int, prompts: int = 6, tokens: int = 32) -> dict[str, list[int]]:
    """Per prompt, how many of the first `tokens` greedy tokens equal those of transformers loading the same file
    (dequantized, fp32): Pagoda with mixed activations (the default: int8 with a second digit in outlier blocks),
    int8 (llama.cpp's rounding), int16 (x as two int8 digits) and float32, each with its prefill (x to int16 where
    the CPU has AVX512-VNNI; models/quant.py), and llama.cpp (which rounds x to 8 bits too). Printed; a quantized
    mode's goal is met when no prompt agrees less than llama.cpp's."""
    from engine import LLM, SamplingParams
    from perf.gpu_correct import divergence, hf_greedy
    ids = [prompt_ids(48, seed=500 + i) for i in range(prompts)]
    hf = reference(file)
    want = [hf_greedy(hf, p, tokens) for p in ids]
    del hf
    agree = lambda got: [tokens if (d := divergence(g, w)) is None else d for g, w in zip(got, want)]  # noqa: E731
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out = {}
    for acts in ("mixed", "int8", "int16", "float32"):
        llm = LLM(model=str(file), quantized_activations=acts, num_threads=threads)
        out[f"Pagoda {acts}"] = agree([o.token_ids for o in llm.generate(ids, [params] * len(ids))])
        del llm
    peer = llama_peer.Peer(file, threads)
    try:
        out["llama.cpp"] = agree([peer.greedy(p, tokens) for p in ids])
    finally:
        peer.close()
    met = {acts: all(a >= b for a, b in zip(out[f"Pagoda {acts}"], out["llama.cpp"]))
           for acts in ("mixed", "int8", "int16")}
    print(f"{file.name}: greedy tokens equal to transformers' (of {tokens}, per prompt): "
          + "; ".join(f"{k} {v}" for k, v in out.items())
          + "; at least llama.cpp's on every prompt: " + ", ".join(f"{k} {v}" for k, v in met.items()))
    return out


def reference(file: Path):
    """transformers' fp32 model of the file, with the Llama 3 RoPE scaling its GGUF reader drops (llama.cpp's
    `rope_freqs`, divisors of the inverse frequencies) put back into its rotary embedding."""
    import torch
    import transformers

    from engine.models.config import ModelConfig
    cfg = ModelConfig.from_dir(file)
    # the embedding's rows, not the tokenizer's count (transformers' reading), where a file pads one of them
    hf = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                           vocab_size=cfg.vocab_size).eval()
    if divisors := cfg.rope["full_attention"].divisors:
        rope = hf.model.rotary_emb
        rope.inv_freq = rope.original_inv_freq = rope.inv_freq / torch.tensor(divisors, dtype=torch.float32)
    return hf


def resident(file: Path, threads: int) -> str:
    """A fresh process's resident memory after loading the file (over what its imports hold), against the file and
    the KV pool: the issue's goal is at most 1.25x the file plus the pool."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        load, request, kv = pool.apply(_resident, (str(file), threads))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        tok = pool.apply(_tokenizer, (str(file),))
    size = file.stat().st_size / 2**20
    return (f"{file.name}: resident after load {load:.0f} MiB over imports = {(load - kv) / size:.2f}x the file "
            f"({size:.0f} MiB) + the KV pool ({kv:.0f} MiB); after a first request {(request - kv) / size:.2f}x; "
            f"the tokenizer alone {tok:.0f} MiB (in a process of its own, with what it imports to convert), "
            f"{(load - kv - tok) / size:.2f}x without it")


def _tokenizer(file: str) -> float:
    """A fresh process's resident memory after building the file's tokenizer, over the same imports (the file's
    metadata pages it reads count here, and the model's process maps them too)."""
    import torch  # noqa: F401

    from engine import LLM  # noqa: F401
    from engine.models.loader import trim
    from engine.tokenizer import Tokenizer
    rss = lambda: next(int(line.split()[1]) for line in open("/proc/self/status")  # noqa: E731
                       if line.startswith("VmRSS")) / 1024
    base = rss()
    tok = Tokenizer(file)
    trim()
    grown = rss() - base
    del tok
    return grown


def _resident(file: str, threads: int) -> tuple[float, float, float]:
    import torch  # noqa: F401  (imports first: they are the baseline)

    from engine import LLM, SamplingParams
    rss = lambda: next(int(line.split()[1]) for line in open("/proc/self/status")  # noqa: E731
                       if line.startswith("VmRSS")) / 1024
    base = rss()
    llm = LLM(model=file, num_threads=threads)
    load = rss() - base
    runner = llm.engine.runner
    caches = [getattr(runner, name, None) for name in ("k_cache", "v_cache")]
    kv = sum(t.numel() * t.element_size() for t in caches if t is not None) / 2**20
    llm.generate([prompt_ids(64, seed=1)], SamplingParams(max_tokens=8))
    return load, rss() - base, kv
