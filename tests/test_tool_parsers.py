"""The tool-call parsers and the reasoning split on text in each family's own format (Qwen's function-calling docs,
Llama 3.x's and Mistral's templates), whole and streamed with the text cut at every boundary."""
from __future__ import annotations

import json

import pytest

from engine.frontends.openai import reasoning
from engine.frontends.openai.tool_parsers import PARSERS, guess
from engine.frontends.openai.tools import Differ, Reader, ToolChoice, View, message
from engine.models.preset_tokenizers import LLAMA3_CHAT_TEMPLATE, QWEN25_CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_current_temperature", "get_temperature_date", "get_weather", "get_time")]
WEATHER = {"name": "get_weather", "arguments": '{"city": "Zürich", "days": [1, 2]}'}
TIME = {"name": "get_time", "arguments": '{"zone": "CET"}'}
# (parser, text, content, calls)
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
     '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
     '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>',
     "Let me check.", [{"name": "get_current_temperature", "arguments": '{"location": "San Francisco, CA, USA"}'},
                       {"name": "get_temperature_date",
                        "arguments": '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'}]),
    ("hermes", '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>', None, [TIME]),
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Zürich", "days": [1, 2]}}', None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "days": [1, 2]}}; '
     '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [WEATHER, TIME]),
    ("llama3_json", "It is sunny {mostly}.", "It is sunny {mostly}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [WEATHER, TIME]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather{"city": "Zürich", "days": [1, 2]}[TOOL_CALLS]get_time{"zone": "CET"}',
     "Sure.", [WEATHER, TIME]),
]


def reader(parser: str) -> Reader:
    return Reader(ToolChoice.of(TOOLS, "auto", True, parser, True), parser, None)


def streamed(read: Reader, chunks: list[str]) -> tuple[dict, list[dict]]:
    """The message a client puts together from the stream's deltas (and the deltas themselves)."""
    differ, text, deltas = Differ(read.parser), "", []
    for i, chunk in enumerate(chunks):
        text += chunk
        deltas.append(differ.delta(read.view(text, final=i == len(chunks) - 1)))
    out = {"content": "", "reasoning": "", "calls": {}}
    for d in deltas:
        out["content"] += d.get("content", "")
        out["reasoning"] += d.get("reasoning", "")
        for call in d.get("tool_calls", ()):
            got = out["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert got["name"] is None and call["type"] == "function" and call["id"]
                got["name"] = call["function"]["name"]
            got["arguments"] += call["function"]["arguments"]
    return out, deltas


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_text(parser, text, content, calls):
    view = reader(parser).view(text, final=True)
    got = message(view, ["id"] * len(view.calls))
    assert got["content"] == (content if content is not None else None)
    assert [c["function"] for c in got.get("tool_calls", [])] == calls
    for call in calls:
        json.loads(call["arguments"])


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_at_every_boundary(parser, text, content, calls):
    """Cut in two at every character, and one character a chunk: the deltas add up to the whole message, a call's
    first delta carries its complete name, and no delta shows part of a tag."""
    read = reader(parser)
    final = message(read.view(text, final=True), ["id"] * len(calls))
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        got, deltas = streamed(read, chunks)
        assert [got["calls"][i] for i in sorted(got["calls"])] == calls, chunks
        assert got["content"].strip() == (final["content"] or "")
        for d in deltas:
            for tag in ("<tool_call", "[TOOL_CALLS", "<|python_tag"):
                assert tag not in d.get("content", "")


@pytest.mark.parametrize("text,thought,answer", [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "It is 4."),
    ("Let me see.\n</think>\n\nIt is 4.", "Let me see.\n", "It is 4."),         # <think> was in the prompt
    ("<think>\nStill thinking", "\nStill thinking", ""),                        # cut by max_tokens
])
def test_reasoning_split_whole_and_streamed(text, thought, answer):
    assert reasoning.split(text, final=True) == (thought, answer)
    assert reasoning.split(text, thinking=False, final=True) == ("", text)
    read = Reader(None, None, "qwen3")
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        got, _ = streamed(read, chunks)
        assert (got["reasoning"], got["content"]) == (thought, answer), chunks


def test_tool_calls_only_in_the_answer():
    read = Reader(ToolChoice.of(TOOLS, "auto", True, "hermes", True), "hermes", "qwen3")
    text = '<think>\nMaybe <tool_call>\n{"name": "get_time"\n</think>\n\n<tool_call>\n' \
           '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    view = read.view(text, final=True)
    assert view.reasoning.startswith("\nMaybe <tool_call>")
    assert [(c.name, c.arguments) for c in view.calls] == [("get_time", '{"zone": "CET"}')]
    assert read.finish(view, "stop") == "tool_calls" and read.finish(view, "length") == "length"


def test_forced_choices_and_parallel_off():
    required = Reader(ToolChoice.of(TOOLS, "required", False, None, False), None, None)
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {}}]'
    assert [c.name for c in required.view(text, final=True).calls] == ["get_time"]
    named = Reader(ToolChoice.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, None, False),
                   None, None)
    view = named.view('{"zone": "CET"}', final=True)
    assert [(c.name, c.arguments) for c in view.calls] == [("get_time", '{"zone": "CET"}')]
    assert named.finish(view, "stop") == "stop"
    assert named.view('{"zone": "CE', final=True).calls == []        # cut short: not returned
    assert View().calls == []


@pytest.mark.parametrize("tools,choice,why", [
    ([], None, "tools: must not be an empty array"),
    (None, "required", "tool_choice: needs tools"),
    (TOOLS, "sometimes", "tool_choice: expected none, auto, required"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice: 'nope' does not match"),
    ([{"type": "function", "function": {}}], None, "tools.0: expected"),
    (TOOLS, "auto", 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice'),
])
def test_bad_tool_requests_name_the_field(tools, choice, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        ToolChoice.of(tools, choice, None, "hermes", False)


def test_parser_guessed_from_the_template():
    assert guess(QWEN25_CHAT_TEMPLATE) == "hermes"
    assert guess(LLAMA3_CHAT_TEMPLATE) == "llama3_json"
    assert guess("{{ messages }}") is None
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}


def test_templates_render_tools_as_transformers_does():
    """The server's Jinja environment against transformers' apply_chat_template on the presets' templates: tools,
    an assistant's tool_calls (arguments as the object, as the server passes them), tool results, and Qwen3's
    enable_thinking from chat_template_kwargs."""
    from tokenizers import Tokenizer as Bare
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from engine.models.preset_tokenizers import QWEN3_CHAT_TEMPLATE
    from engine.tokenizer import Tokenizer
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Zürich"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    for template in (QWEN25_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE):
        hf = PreTrainedTokenizerFast(tokenizer_object=Bare(models.BPE()), bos_token="<|begin_of_text|>")
        hf.chat_template = template
        ours = Tokenizer.__new__(Tokenizer)
        ours.chat_template, ours.specials = template, {"bos_token": "<|begin_of_text|>"}
        for messages, tools, kwargs in [(chat, TOOLS, {}), (chat[1:2], None, {}),
                                        (chat, TOOLS, {"enable_thinking": False})]:
            want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
            assert ours.apply_chat_template(messages, tools=tools, **kwargs) == want
            assert not tools or '"name": "get_weather"' in want and "Zürich" in want
