"""OpenAI request bodies (pydantic) and their translation to SamplingParams; extensions as vLLM names them.

As vLLM's server does, a field this server does not know is accepted and ignored, and each set of such names is
logged once (routers and SDKs add their own to every request). A field it knows but does not honour yet is refused,
naming it, unless its value asks for nothing (a penalty of 0, `logprobs` false): a client is never answered as if
it had been honoured.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.core.sampling import SamplingParams
from engine.core.structured import StructuredOutputs

log = logging.getLogger("pagoda")
_IGNORED: set[tuple[str, ...]] = set()     # sets of unknown field names already logged
# known, not honoured yet -> the values that ask for nothing
NOT_YET: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""),
}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None      # vLLM's extra field
    guided_json: dict[str, Any] | str | None = None       # vLLM's legacy extra fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    not_yet: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _sort_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = sorted(k for k in data if k not in cls.model_fields and k not in NOT_YET)
        if unknown and tuple(unknown) not in _IGNORED:
            if len(_IGNORED) < 256:            # once per set: a router adds the same fields to every request
                _IGNORED.add(tuple(unknown))
            log.info("openai: ignored fields the server does not know: %s", ", ".join(unknown))
        asked = {k: v for k, v in data.items() if k in NOT_YET and v not in NOT_YET[k]}
        return {**{k: v for k, v in data.items() if k not in NOT_YET}, "not_yet": asked}

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.not_yet:
            name = next(iter(self.not_yet))
            raise ValueError(f"{name}: not supported by this server yet, got {self.not_yet[name]!r}")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=self.top_tokens(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                              logit_bias=self.logit_bias, include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structure(),
                              spaces_between_special_tokens=self.spaces_between_special_tokens,
                              bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
                              truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.prompt_logprobs,
                              cache_salt=self.cache_salt)

    def structure(self) -> StructuredOutputs | None:
        """What the output must match: response_format (OpenAI), structured_outputs or a guided_* field (vLLM)."""
        asked = [name for name in ("response_format", "structured_outputs", *GUIDED) if getattr(self, name)
                 and getattr(self, name) != {"type": "text"}]
        if len(asked) > 1:
            raise ValueError(f"{asked[1]}: give one of {', '.join(asked)}, not both")
        if not asked:
            return None
        name = asked[0]
        if name == "structured_outputs":
            return StructuredOutputs.parse(self.structured_outputs)
        if name in GUIDED:
            return StructuredOutputs.of(GUIDED[name], getattr(self, name), name)
        return response_format(self.response_format)

    def top_tokens(self) -> int | None:
        """How many top tokens per position the request's logprobs ask for; None: no logprobs."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None

    def top_tokens(self) -> int | None:
        return self.logprobs


class Message(BaseModel):
    """A chat turn as the templates read it: text content (a list of text parts is joined), an assistant's
    tool_calls (their JSON-string arguments parsed, as vLLM passes them), a tool result's tool_call_id."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: needed, unless an assistant message carries tool_calls")
        return self

    def template(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise ValueError("messages: only text content parts are supported")
            out["content"] = "".join(part.get("text", "") for part in self.content)
        if out.get("reasoning_content") is not None and "reasoning" not in out:
            out["reasoning"] = out.pop("reasoning_content")
        for call in out.get("tool_calls", ()):
            fn = call.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = arguments(fn["arguments"])
        return out


def arguments(text: str) -> Any:
    """A tool call's arguments as the templates take them: the object its JSON text holds (else the text)."""
    import json
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def top_tokens(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        return (self.top_logprobs or 0) if self.logprobs else None


def response_format(value: dict[str, Any]) -> StructuredOutputs:
    """OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputs.of("json_object", True, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format: json_schema needs {\"name\": ..., \"schema\": {...}}")
        return StructuredOutputs.of("json", spec["schema"], "response_format")
    raise ValueError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
