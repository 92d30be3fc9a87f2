"""gpu_check's correctness section: the engine's greedy tokens on the device against the CPU engine and
transformers (fp32), in every mode a user can pick, and bf16's first divergence from transformers' bf16.

A case is one (preset, storage, CUDA graphs, lookahead) engine serving four requests: a cold prompt alone, a
prompt-cache hit on it alone, then a batch of four (two more cold prompts and two hits) together."""
from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.models.presets import cached_model
from perf.common import prompt_ids


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, EOS ignored: its own forward and KV cache, argmax each step."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=dev), use_cache=True)
        tokens = []
        for _ in range(n):
            token = out.logits[0, -1].argmax()
            tokens.append(int(token))
            out = model(token.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def hf_model(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ; None when they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))




SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def prompts(length: int) -> list[list[int]]:
    """[cold A, hit on A, cold B, hit on A, cold C, hit on A]: each hit keeps all but A's last 5 tokens. (Dense
    storage lends a stored buffer to one request at a time, so in the batch one hit may miss.)"""
    a, b, c = (prompt_ids(length, seed=s) for s in (11, 12, 13))
    hit = lambda seed: a[:-5] + prompt_ids(5, seed=seed)       # noqa: E731
    return [a, hit(21), b, hit(22), c, hit(23)]


def serve(llm: LLM, ps: list[list[int]], n: int, lookahead: bool) -> tuple[list[list[int]], list[int]]:
    """The six prompts' tokens ([0] and [1] alone, the rest as one batch) and each one's cached tokens."""
    llm.engine.lookahead.enabled = lookahead
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = [llm.generate(ps[0], params)[0], llm.generate(ps[1], params)[0], *llm.generate(ps[2:], params)]
    return [o.token_ids for o in outs], [o.cached_tokens for o in outs]


def greedy_identity(s) -> tuple[dict, list[dict]]:
    results, failures = {"cases": []}, 0
    for preset in s.presets:
        path = str(cached_model(preset))
        ps = prompts(s.prompt)
        cpu = LLM(model=path, device="cpu", dtype="float32", kv_storage="paged", lookahead=False)
        want, _ = serve(cpu, ps, s.tokens, lookahead=False)
        del cpu
        hf = hf_model(path, torch.float32, "cpu")
        anchor = [hf_greedy(hf, p, s.tokens) for p in ps]
        del hf
        results[f"{preset}: CPU engine vs transformers"] = [divergence(a, b) for a, b in zip(want, anchor)]
        # the last case verifies n-gram drafts as multi-row decode steps through the same kernels and graphs
        cases = [("paged", g, None) for g in s.graphs] + [("dense", "false", None), ("paged", "true", SPEC)]
        for storage, graphs, spec in cases:
            llm = LLM(model=path, device=s.device, dtype="float32", kv_storage=storage, cuda_graphs=graphs,
                      attention=s.attention, max_batch_size=4, num_kv_blocks=s.blocks if storage == "paged" else 0,
                      max_model_len=s.max_len, speculative_config=spec)
            if llm.engine.spec is not None:
                llm.engine.spec.chain = True         # a GPU's default: the dry run's CPU rehearses it
            for lookahead in s.lookaheads if spec is None else (True,):
                got, cached = serve(llm, ps, s.tokens, lookahead)
                vs_cpu = [divergence(g, w) for g, w in zip(got, want)]
                vs_hf = [divergence(g, a) for g, a in zip(got, anchor)]
                ok = all(d is None for d in vs_cpu + vs_hf) and cached[1] > 0 and max(cached[3], cached[5]) > 0
                failures += not ok
                results["cases"].append({"preset": preset, "storage": storage, "cuda_graphs": graphs,
                                         "speculative": spec is not None, "lookahead": lookahead, "ok": ok,
                                         "cached": cached,
                                         "diverges_from_cpu_at": vs_cpu, "diverges_from_transformers_at": vs_hf})
                if spec is not None:      # verify steps launched from the step in flight: lookahead's counter
                    m = llm.engine.metrics
                    results["cases"][-1]["pipelined_of_decode_steps"] = \
                        [llm.engine.lookahead.pipelined, int(m.value("pagoda_decode_steps_total"))]
            del llm
    cases = len(results["cases"])
    goal = {"name": "fp32 greedy = CPU engine = transformers", "value": f"{cases - failures}/{cases} cases",
            "goal": "all", "met": failures == 0}
    return results, [goal]


def bf16_divergence(s) -> tuple[dict, list[dict]]:
    """Reported, not asserted: bf16 rounds differently in every implementation, so greedy paths part once two
    logits come within an ulp."""
    path = str(cached_model(s.bf16_model))
    ps = prompts(s.prompt)[:3]
    llm = LLM(model=path, device=s.device, dtype="bfloat16", kv_storage="paged", attention=s.attention,
              num_kv_blocks=s.blocks)
    got, _ = serve(llm, ps, s.bf16_tokens, lookahead=True)
    del llm
    hf = hf_model(path, torch.bfloat16, s.device)
    anchor = [hf_greedy(hf, p, s.bf16_tokens) for p in ps]
    del hf
    at = [divergence(g, a) for g, a in zip(got, anchor)]
    row = {"name": f"bf16 {s.bf16_model} first divergence from transformers",
           "value": ", ".join("none" if d is None else str(d) for d in at) + f" (of {s.bf16_tokens})",
           "goal": "reported", "met": None}
    return {"first_divergence": at, "tokens": s.bf16_tokens}, [row]
