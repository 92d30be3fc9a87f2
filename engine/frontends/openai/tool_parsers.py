"""Tool calls in a model's text, in the three formats vLLM's parsers of the same names read: `hermes` (Qwen2.5,
Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>), `llama3_json` (Llama 3.x: the whole answer is
{"name": ..., "parameters": {...}}, optionally after <|python_tag|>, several joined by "; ") and `mistral`
([TOOL_CALLS] then a JSON list of {"name", "arguments"}, or name{arguments} per call in the v11 tokenizer's form).

A parser reads the whole text so far and answers what is safe to show: the content outside the calls (never a
partial start tag), and per call its name once the name is complete and its arguments' text so far. Streaming
sends the growth of that answer; the arguments of a call are the JSON text the model wrote (as it wrote it), so
the streamed fragments add up to the final arguments exactly.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass(slots=True)
class Call:
    name: str
    arguments: str = ""              # the JSON text so far; complete once `done`
    done: bool = False


@dataclass(slots=True)
class Parsed:
    content: str                     # the text outside the calls that is safe to show
    calls: list[Call] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        """Every call complete and its arguments a JSON object."""
        return all(c.done and _object(c.arguments) for c in self.calls)


def _object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array starting at text[start] (None: not closed yet)."""
    depth, string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if string:
            escape, string = (False, string) if escape else (ch == "\\", ch != '"')
        elif ch == '"':
            string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def held(text: str, tag: str, final: bool = False) -> str:
    """text without a trailing prefix of `tag` (it may be the start of one), unless the text is final."""
    for n in () if final else range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_call(body: str, keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """A call from the text of {"name": ..., "<key>": {...}} so far: None until its name is complete."""
    name = _NAME.search(body)
    if name is None:
        return None
    call = Call(json.loads(f'"{name.group(1)}"'))
    arg = re.search(r'"(?:%s)"\s*:\s*' % "|".join(keys), body)
    if arg is None:
        call.done = value_end(body.lstrip(), 0) is not None      # no arguments: an empty object
        call.arguments = "{}" if call.done else ""
        return call
    start = arg.end()
    end = value_end(body, start) if start < len(body) and body[start] in "{[" else None
    call.arguments = body[start:end] if end is not None else body[start:]
    call.done = end is not None and value_end(body.lstrip(), 0) is not None
    return call


def calls(text: str, at: int, sep: str, keys: tuple[str, ...] = ("arguments",)) -> list[Call]:
    """The calls of JSON objects one after another from text[at], `sep` and blanks between them."""
    out = []
    while True:
        while at < len(text) and (text[at] in sep or text[at].isspace()):
            at += 1
        if at >= len(text) or text[at] != "{":
            return out
        end = value_end(text, at)
        call = json_call(text[at:end], keys)
        if call is None:
            return out
        call.done = call.done and end is not None
        out.append(call)
        if end is None:
            return out
        at = end


class Hermes:
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = False) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(held(text, self.start, final))
        out = Parsed(text[:first])
        for piece in text[first:].split(self.start)[1:]:
            body = piece.split(self.end)[0].strip()
            call = json_call(body)
            if call is None:
                break
            call.done = call.done and self.end in piece
            out.calls.append(call)
        return out


class Llama3Json:
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = False) -> Parsed:
        stripped = text.lstrip()
        if not stripped or held(stripped, self.tag, final) == "":
            return Parsed(text if final else "")
        if stripped.startswith(self.tag):
            stripped = stripped[len(self.tag):].lstrip()
            if not stripped and not final:
                return Parsed("")
        if not stripped.startswith("{"):
            return Parsed(text)
        return Parsed("", calls(stripped, 0, ";", ("parameters", "arguments")))


class Mistral:
    name = "mistral"
    tag = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool = False) -> Parsed:
        first = text.find(self.tag)
        if first < 0:
            return Parsed(held(text, self.tag, final))
        out, rest = Parsed(text[:first]), text[first + len(self.tag):].lstrip()
        if rest.startswith("["):                      # a JSON list of calls
            out.calls = calls(rest, 1, ",")
            return out
        for piece in rest.split(self.tag):               # name{arguments}, each after its own tag
            brace = piece.find("{")
            if brace < 0:
                break
            end = value_end(piece, brace)
            args = piece[brace:end] if end is not None else piece[brace:]
            out.calls.append(Call(piece[:brace].strip(), args, end is not None))
        return out


PARSERS = {p.name: p for p in (Hermes(), Llama3Json(), Mistral())}


def guess(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool section writes for (`--tool-call-parser auto`); None: unclear."""
    template = chat_template or ""
    found = [name for name, mark in (("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                                     ("llama3_json", '"parameters"')) if mark in template]
    return found[0] if len(found) == 1 else None
