"""LLM: the offline API, shaped like vLLM's: generate(prompts, params) -> one RequestOutput per prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

Prompt = str | list[int]


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    cached_tokens: int
    error: str | None = None


class LLM:
    def __init__(self, model: str | None = None, runner: str = "torch", device: str = "auto", dtype: str = "auto",
                 max_batch_size: int = 4, kv_storage: str = "auto", block_size: int = 32, prompt_cache: bool = True,
                 lookahead: bool = True, **options: Any) -> None:
        config = EngineConfig(model=model, runner=runner, device=device, dtype=dtype, max_batch_size=max_batch_size,
                              kv_storage=kv_storage, block_size=block_size, prompt_cache=prompt_cache,
                              lookahead=lookahead, **options)
        self.engine = Engine(config)

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        engine = self.engine
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        mine = {r.id: r for r in reqs}
        pending = list(reqs)
        outputs: dict[int, RequestOutput] = {}
        while pending or engine.has_work:
            while pending and len(engine.scheduler.waiting) < engine.config.max_queue:
                engine.add(pending.pop(0))
            for d in engine.step():
                if d.finished and d.request_id in mine:
                    req = mine[d.request_id]
                    outputs[d.request_id] = RequestOutput(req.id, req.prompt_ids, req.output_ids, req.text,
                                                          req.finish_reason, len(req.prompt_ids), d.cached_tokens,
                                                          req.error)
        return [outputs[r.id] for r in reqs]
