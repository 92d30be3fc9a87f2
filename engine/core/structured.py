"""StructuredOutputs: what a request's output must match, in vLLM's StructuredOutputsParams shape. Only the shape is
checked here; engine/grammar.py compiles it (and names the field when a schema, regex or grammar is invalid)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's other StructuredOutputsParams keys -> the values accepted (our matching is always xgrammar's, whitespace
# always bounded); the legacy guided_decoding's `backend` names the engine, and only xgrammar's names pass
OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False, True), "disable_any_whitespace": (False, True), "whitespace_pattern": (None,),
    "disable_additional_properties": (False,), "structural_tag": (None,), "backend": (None, "xgrammar", "auto"),
}


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as its text), `json_object` (any JSON object), `regex`, `choice` (one of
    these strings, exactly), `grammar` (EBNF in xgrammar's dialect, rule `root` first)."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_outputs.json"  # the request's field it came from (e.g. response_format): errors name it

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def parse(cls, value: Any, field: str = "structured_outputs") -> StructuredOutputs | None:
        """From a dict, or its JSON text (Triton's sampling_parameters carry it so, as vllm_backend takes it)."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, field, f"an object with one of {', '.join(KINDS)}")
        asked = {k: v for k, v in value.items() if k in KINDS and v not in (None, False)}
        for key, v in value.items():
            if key not in KINDS and key not in OPTIONS:
                raise ValueError(f"{field}.{key}: unknown key (known: {', '.join(KINDS + tuple(OPTIONS))})")
            if key in OPTIONS and v not in OPTIONS[key]:
                raise ValueError(f"{field}.{key}: not supported by this server, got {v!r}")
        if len(asked) != 1:
            raise ValueError(f"{field}: give exactly one of {', '.join(KINDS)}, got {sorted(asked) or 'none'}")
        (kind, v), = asked.items()
        return cls.of(kind, v, f"{field}.{kind}")

    @classmethod
    def of(cls, kind: str, value: Any, field: str) -> StructuredOutputs:
        """One kind, from a field of its own (OpenAI's response_format, vLLM's legacy guided_json, ...)."""
        return cls(field=field, **{kind: _check(field, kind, value)})


def json_object(value: Any, field: str, what: str = "an object") -> dict:
    """A request's or option's object, given as one or as its JSON text; ValueError naming the field."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{field}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: expected {what}, got {value!r}")
    return value


def _check(where: str, kind: str, value: Any) -> Any:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"{where}: expected a JSON schema (an object), got {value!r}")
        return json.dumps(value)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{where}: expected true, got {value!r}")
        return True
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{where}: expected a list of non-empty strings, got {value!r}")
        return tuple(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value
