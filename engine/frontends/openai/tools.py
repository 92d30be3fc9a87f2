"""A chat request's tools as vLLM's server takes them: which calls the output may or must make (tool_choice), the
grammar that holds generation to them, and the output read back into OpenAI's message (content, tool_calls,
reasoning) whole or as stream deltas.

- "none": the tools reach the template only; the output is text.
- "auto" (the default when tools are given; needs --enable-auto-tool-choice): free text, but once the model opens
  a call in its parser's format (<tool_call>, [TOOL_CALLS], Llama's leading {"name": ...) the rest of the call is
  held to the tools' names and parameter schemas, so an `auto` call always parses and validates.
- "required": a JSON list of {"name", "parameters"} over the tools (vLLM's schema); a named function: its
  parameters' schema, the whole output being the arguments.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from engine.core.structured import StructuredOutputs
from engine.frontends.openai import reasoning
from engine.frontends.openai.tool_parsers import PARSERS, Call, Parsed, calls, value_end


@dataclass(slots=True)
class ToolChoice:
    tools: list[dict]                      # the functions: {"name", "description"?, "parameters"?}
    mode: str                              # none | auto | required | named
    name: str | None = None                # the named function
    parallel: bool = True

    @staticmethod
    def of(tools: list[dict] | None, choice: Any, parallel: bool | None, parser: str | None,
           auto_enabled: bool) -> ToolChoice | None:
        """Validated as vLLM validates them; ValueError naming the field."""
        if tools is not None and not tools:
            raise ValueError("tools: must not be an empty array (give at least one tool or leave the field out)")
        if not tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice: needs tools")
            return None
        functions = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools.{i}: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"tools.{i}.function.parameters: expected a JSON schema (an object)")
            functions.append(fn)
        choice = "auto" if choice is None else choice
        names = [f["name"] for f in functions]
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or name not in names:
                raise ValueError(f"tool_choice: {name!r} does not match any of the tools ({', '.join(names)})")
            made = ToolChoice(functions, "named", name)
        elif choice in ("none", "auto", "required"):
            made = ToolChoice(functions, choice)
        else:
            raise ValueError(f"tool_choice: expected none, auto, required or a named function, got {choice!r}")
        if made.mode == "auto" and not (auto_enabled and parser):
            raise ValueError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                             "--tool-call-parser")
        made.parallel = parallel is not False
        return made

    def params(self, name: str) -> dict:
        fn = next(f for f in self.tools if f["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def structure(self, parser: str | None) -> StructuredOutputs | None:
        """What generation is held to (None: free text)."""
        if self.mode == "named":
            return StructuredOutputs.of("json", self.params(self.name), "tool_choice")
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                       "parameters": self.params(f["name"])},
                      "required": ["name", "parameters"]} for f in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs.of("json", schema, "tool_choice")
        if self.mode == "auto":
            from engine.grammar import tool_calls
            return StructuredOutputs(grammar=tool_calls(parser, [(f["name"], self.params(f["name"]))
                                                                 for f in self.tools], self.parallel),
                                     field="tools")
        return None


def forced(choice: ToolChoice, text: str) -> Parsed:
    """The calls of a required or named choice's output (JSON the grammar held it to)."""
    if choice.mode == "named":
        end = value_end(text, 0) if text.startswith("{") else None
        return Parsed("", [Call(choice.name, text if end is None else text[:end], end is not None)])
    return Parsed("", calls(text, 1, ",", ("parameters",)) if text.startswith("[") else [])


@dataclass(slots=True)
class View:
    """What a chat choice's text shows so far."""
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


@dataclass(slots=True)
class Reader:
    """Turns a chat choice's text into a View, by the request's tool choice and the server's parsers."""
    choice: ToolChoice | None
    parser: str | None
    reasoning: str | None
    thinking: bool = True

    @property
    def active(self) -> bool:
        return self.reasoning is not None or (self.choice is not None and self.choice.mode != "none")

    def view(self, text: str, final: bool = False) -> View:
        thought, answer = reasoning.split(text, self.thinking, final) if self.reasoning else ("", text)
        mode = self.choice.mode if self.choice else "none"
        if mode in ("required", "named"):
            parsed = forced(self.choice, answer)
        elif mode == "auto":
            parsed = PARSERS[self.parser].parse(answer, final)
        else:
            parsed = Parsed(answer)
        made = parsed.calls if self.choice is None or self.choice.parallel else parsed.calls[:1]
        if final:                # a call max_tokens cut short is not returned whole (a stream showed its start)
            made = [c for c in made if c.done]
        return View(thought, parsed.content.strip() if made else parsed.content, made)

    def finish(self, view: View, reason: str | None) -> str | None:
        """vLLM's finish_reason: "tool_calls" once calls were made (not for a named function, which OpenAI ends
        with "stop"), unless the output was cut short by max_tokens."""
        if view.calls and reason == "stop" and self.choice is not None and self.choice.mode != "named":
            return "tool_calls"
        return reason


def call_id(parser: str | None) -> str:
    if parser == "mistral":                       # Mistral's tokenizer takes 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def message(view: View, ids: list[str]) -> dict[str, Any]:
    """The non-streamed assistant message."""
    out: dict[str, Any] = {"role": "assistant", "content": view.content or (None if view.calls else "")}
    if view.reasoning:
        out["reasoning"] = out["reasoning_content"] = view.reasoning
    if view.calls:
        out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c, i in zip(view.calls, ids)]
    return out


class Differ:
    """A stream's deltas: the growth of one choice's View since the last one sent."""

    def __init__(self, parser: str | None) -> None:
        self.parser, self.sent, self.ids = parser, View(), []

    def delta(self, view: View) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if len(view.reasoning) > len(self.sent.reasoning):
            out["reasoning"] = out["reasoning_content"] = view.reasoning[len(self.sent.reasoning):]
        if len(view.content) > len(self.sent.content):
            out["content"] = view.content[len(self.sent.content):]
        calls = []
        for i, call in enumerate(view.calls):
            if i >= len(self.sent.calls):
                self.ids.append(call_id(self.parser))
                calls.append({"index": i, "id": self.ids[i], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > len(self.sent.calls[i].arguments):
                grown = call.arguments[len(self.sent.calls[i].arguments):]
                calls.append({"index": i, "function": {"arguments": grown}})
        if calls:
            out["tool_calls"] = calls
        self.sent = View(view.reasoning, view.content, [Call(c.name, c.arguments, c.done) for c in view.calls])
        return out
