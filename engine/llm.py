"""LLM: the offline API, shaped like vLLM's: generate(prompts, params) -> one RequestOutput per prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, from_kwargs
from engine.core.engine import Engine
from engine.core.output import Delta, PositionLogprobs
from engine.core.request import Request
from engine.core.sampling import SamplingParams

Prompt = str | list[int]


@dataclass(slots=True)
class CompletionOutput:
    """One sequence of a request (vLLM's name and fields)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None     # per generated token, when params.logprobs is set
    cumulative_logprob: float | None = None

    @classmethod
    def of(cls, seq: Request) -> "CompletionOutput":
        cumulative = None if seq.logprobs is None else seq.cumulative_logprob
        return cls(seq.index, seq.text, seq.output_ids, seq.finish_reason, seq.logprobs, cumulative)


@dataclass(slots=True)
class RequestOutput:
    """A request's result. `outputs`: one CompletionOutput per sequence (n of them); the fields below it repeat the
    first sequence's, for the common n = 1."""
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None    # per prompt token (None first), when asked

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob


class LLM:
    """The offline engine, as vLLM's `LLM`: `LLM(model=None, **options)`. `model` is a Hugging Face directory or a
    .gguf file (default: the embedded small model, made on first use); `options` are EngineConfig fields by name
    (dtype, max_batch_size, kv_storage, ...), and PAGODA_<NAME> sets those not given. The step loop runs in the
    calling thread, inside `generate`."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.finals: dict[int, Delta] = {}
        given = options if model is None else {"model": model, **options}   # None: PAGODA_MODEL, or the default
        config = from_kwargs(EngineConfig, given)
        self.engine = Engine(config, on_delta=self._collect)

    def _collect(self, delta: Delta) -> None:
        if delta.finished:
            self.finals[delta.request_id] = delta

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (text, token ids, or a list of either) to completion, batched as `max_batch_size` allows;
        one RequestOutput per prompt, in order. `params`: one for all, or one per prompt (default SamplingParams())."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        engine = self.engine
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        pending = list(reqs)
        while pending or engine.has_work:
            while pending and len(engine.scheduler.waiting) < engine.config.max_queue:
                engine.add(pending.pop(0))
            engine.step()
        finals = [self.finals.pop(r.id) for r in reqs]
        return [RequestOutput(r.id, r.prompt_ids, [CompletionOutput.of(s) for s in r.group or [r]],
                              len(r.prompt_ids), d.cached_tokens, r.error, r.prompt_logprobs)
                for r, d in zip(reqs, finals)]
