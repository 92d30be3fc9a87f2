"""SamplingParams: what a request asks of the sampler, validated with errors that name the field."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from engine.core.structured import StructuredOutputs


@dataclass(slots=True)
class SamplingParams:
    """What a request asks of the sampler, with vLLM's names, defaults and meanings (16 new tokens at temperature
    1.0 unless told otherwise). Invalid values raise ValueError naming the field. docs/sampling.md has each one."""
    n: int = 1                        # sequences sampled from the prompt (prefilled once, then forked)
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # the sampled token's logprob and this many top ones per position (0-20)
    prompt_logprobs: int | None = None    # each prompt token's logprob and this many top ones (0-20); no cache read
    # vLLM's definitions: presence and frequency over the output, repetition over prompt and output (1: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0                # sampled rows: drop tokens below min_p times the most likely one's probability
    logit_bias: dict[int, float] | None = None    # token id -> added to its logit before sampling (clamped to +-100)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True    # accepted; a fast (tokenizers) detokenizer has no such spacing
    bad_words: list[str] | None = None            # words never generated (their token sequences, with a space too)
    allowed_token_ids: list[int] | None = None    # only these tokens are sampled
    truncate_prompt_tokens: int | None = None     # keep the prompt's last k tokens (-1: as many as the model takes)
    structured_outputs: StructuredOutputs | None = None     # a dict or its JSON text is parsed into one
    cache_salt: str | None = None     # requests share cached KV only with requests of the same salt

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.structured_outputs = StructuredOutputs.parse(self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        _int("n", self.n, low=1)
        _int("max_tokens", self.max_tokens, low=1)
        _int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        _num("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, low=-1)
        if self.seed is not None:
            _int("seed", self.seed, low=0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids: must be a list of integers, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), low=0)
                if getattr(self, name) > MAX_LOGPROBS:
                    raise ValueError(f"{name}: must be <= {MAX_LOGPROBS}, got {getattr(self, name)}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words: must be a list of non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids: must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                _int("allowed_token_ids", t, low=0)
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens: must be >= 1 or -1, got 0")
        for name in ("presence_penalty", "frequency_penalty"):
            _num(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        _num("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _num("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias: must be an object of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _int("logit_bias", token, low=0)
                _num("logit_bias", bias)
            self.logit_bias = {t: min(100.0, max(-100.0, b)) for t, b in self.logit_bias.items()}   # as vLLM
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_SALT):
            raise ValueError(f"cache_salt: must be a non-empty string of at most {MAX_SALT} characters, got "
                             f"{_short(self.cache_salt)}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")

    @classmethod
    def from_json(cls, text: str | bytes) -> "SamplingParams":
        try:
            data = json.loads(text) if text else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"sampling_parameters: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"sampling_parameters: must be a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Accepts the string values Triton clients send ("16", "0.7", "true")."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        legacy = data.get("guided_decoding")      # vllm_backend's older name: used unless structured_outputs is given
        if legacy is not None and data.get("structured_outputs") is None:
            kwargs["structured_outputs"] = StructuredOutputs.parse(legacy, "guided_decoding")
        for key, value in data.items():
            if key == "guided_decoding":
                continue
            if key in NOT_HONOURED and key not in known:
                if _coerce_any(value) not in NOT_HONOURED[key]:
                    raise ValueError(f"{key}: not supported by this server yet, got {value!r}")
                continue                                # a value that asks for nothing
            if key not in known:
                raise ValueError(f"{key}: unknown sampling parameter (known: {', '.join(sorted(known))})")
            kwargs[key] = _coerce(key, value)
        return cls(**kwargs)


MAX_LOGPROBS = 20
MAX_SALT = 256
# vLLM SamplingParams keys (and vllm_backend's lora_name and best_of) this server does not honour yet -> the values
# that ask for nothing, which are accepted
NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,), "logprob_token_ids": (None,), "flat_logprobs": (False,),
    "detokenize": (True,), "output_kind": (None,),
    "stream_interval": (None, 1), "skip_clone": (False, True), "extra_args": (None,),
    "skip_reading_prefix_cache": (None, False), "thinking_token_budget": (None,), "repetition_detection": (None,),
    "routed_experts_prompt_start": (0,), "trace_decode_token_ids": (None,), "lora_name": (None, ""),
}
INTEGER_KEYS = {"n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
                "truncate_prompt_tokens"}
NULLABLE = {"cache_salt", "seed", "logprobs", "prompt_logprobs", "logit_bias", "structured_outputs", "bad_words",
            "allowed_token_ids", "truncate_prompt_tokens"}
_FLOATS = {"temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"}


def _coerce(key: str, value: Any) -> Any:
    if value is None:
        return None if key in NULLABLE else _fail(key, value, "a value")
    if key == "logit_bias" and isinstance(value, dict):      # JSON keys are strings: {"42": -5}
        try:
            return {int(k): float(v) if isinstance(v, str) else v for k, v in value.items()}
        except (TypeError, ValueError):
            return _fail(key, value, "token ids -> numbers")
    if key in INTEGER_KEYS and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return _fail(key, value, "an integer")
    if key in _FLOATS and isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return _fail(key, value, "a number")
    if key in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens") and isinstance(value, str):
        if value.strip().lower() in ("true", "1"):
            return True
        if value.strip().lower() in ("false", "0"):
            return False
        return _fail(key, value, "a boolean")
    if key in _FLOATS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _coerce_any(value: Any) -> Any:
    """A Triton client's string value as the number or boolean it spells, for comparing with neutral values."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}... ({len(value) if isinstance(value, str) else '?'} chars)"


def _fail(key: str, value: Any, what: str) -> Any:
    raise ValueError(f"{key}: expected {what}, got {value!r}")


def _int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")


def _num(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name}: expected a number, got {value!r}")
