"""Tool calling and reasoning through the OpenAI server, with the official `openai` client and the OpenAI Agents SDK,
on random-weight presets: what the model says is noise, so each test holds it with tool_choice (and, for `auto`, a
logit_bias that opens a call); the grammar does the rest, so every call returned must parse and validate."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest

from tests.helpers import openai_serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "metric"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": ZONE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
OPEN_CALL = 151657           # Qwen's <tool_call>


@pytest.fixture(scope="module")
def qwen(qwen_tools_url):
    return qwen_tools_url


def client(url):
    from openai import OpenAI
    return OpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0)


def ask(url, stream: bool = False, **kw):
    """A chat completion, and when streamed, the message the deltas put together."""
    kw = {"model": url.model, "messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **kw}
    c = client(url.url)
    if not stream:
        return c.chat.completions.create(**kw).choices[0]
    calls, content, finish = {}, "", None
    for chunk in c.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            got = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert got["name"] is None and d.function.name and d.type == "function"
                got["name"] = d.function.name
            got["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def valid(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def calls_of(choice) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or ()]


class Url:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model


@pytest.fixture(scope="module")
def q(qwen, qwen_tiny_dir):
    from pathlib import Path
    return Url(qwen, Path(qwen_tiny_dir).name)


@pytest.mark.parametrize("choice,finish", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_forced_calls_whole_and_streamed(q, choice, finish):
    whole = ask(q, tool_choice=choice, parallel_tool_calls=False)
    assert whole.finish_reason == finish and whole.message.content is None
    calls = calls_of(whole)
    assert len(calls) == 1 and calls[0]["name"] in SCHEMAS
    if isinstance(choice, dict):
        assert calls[0]["name"] == "get_time"
    valid(calls)
    assert whole.message.tool_calls[0].id.startswith("chatcmpl-tool-")
    streamed = ask(q, stream=True, tool_choice=choice, parallel_tool_calls=False)
    assert streamed["calls"] == calls and streamed["finish_reason"] == finish


def test_parallel_calls(q):
    """`required` with parallel calls: the list grows until max_tokens; the calls it completed come back whole."""
    whole = ask(q, tool_choice="required", max_tokens=120)
    calls = calls_of(whole)
    assert len(calls) >= 2
    valid(calls)
    assert whole.finish_reason == "length"
    streamed = ask(q, stream=True, tool_choice="required", max_tokens=120)
    assert streamed["calls"][:len(calls)] == calls


def test_auto_call_is_held_to_the_tools(q):
    """`auto`: free text until the model opens a call (here pushed by logit_bias), then the tools' grammar."""
    body = {"tool_choice": "auto", "parallel_tool_calls": False, "logit_bias": {str(OPEN_CALL): 100}}
    whole = ask(q, **body)
    calls = calls_of(whole)
    assert len(calls) == 1 and whole.finish_reason == "tool_calls" and not whole.message.content
    valid(calls)
    streamed = ask(q, stream=True, **body)
    assert streamed["calls"] == calls and streamed["finish_reason"] == "tool_calls"


def test_none_and_auto_without_a_call_are_text(q):
    for choice in ("none", "auto"):
        whole = ask(q, tool_choice=choice, max_tokens=8)
        assert whole.message.tool_calls is None and isinstance(whole.message.content, str)
        assert whole.finish_reason == "length"


def test_tool_results_in_a_second_turn(q):
    first = ask(q, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.message.tool_calls[0]
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = ask(q, messages=turn, tool_choice="required", parallel_tool_calls=False)
    valid(calls_of(second))
    assert second.finish_reason == "tool_calls"


def test_bad_tool_requests_are_400s_naming_the_field(q):
    import openai
    c = client(q.url)
    for kw, field in [({"tools": []}, "tools"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                       "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=q.model, messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == field
    assert c.chat.completions.create(model=q.model, messages=ASK, max_tokens=2).choices[0].message.content is not None


def test_an_agent_runs_a_two_tool_loop(q):
    """The OpenAI Agents SDK drives the loop: the first turn must call get_time, the second get_weather (a run hook
    forces the next tool, as the random weights cannot choose), and the run ends at get_weather's result."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    seen = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        seen.append(("get_time", zone))
        return "12:00"

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"], metric: bool) -> str:
        """The weather in a city."""
        seen.append(("get_weather", city))
        return "sunny"

    class Next(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=60, temperature=0)

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(q.model, AsyncOpenAI(base_url=f"http://{q.url}/v1", api_key="none"))
    agent = agents.Agent(name="assistant", model=model, tools=[get_time, get_weather], reset_tool_choice=False,
                         tool_use_behavior=agents.StopAtTools(stop_at_tool_names=["get_weather"]),
                         model_settings=agents.ModelSettings(tool_choice="get_time", max_tokens=60, temperature=0))
    result = agents.Runner.run_sync(agent, "What time is it, and then the weather?", hooks=Next(), max_turns=4)
    assert [name for name, _ in seen] == ["get_time", "get_weather"]
    assert result.final_output == "sunny"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from pathlib import Path

    from engine.models.presets import make_model
    from engine.tokenizer import Tokenizer
    model_dir = make_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))
    with openai_serving(str(model_dir), tmp_path_factory.mktemp("tools") / "llama.log",
                        "--enable-auto-tool-choice", "--tool-call-parser", "auto") as url:
        yield Url(url, Path(model_dir).name), Tokenizer(model_dir).tok.token_to_id("{")


def test_llama3_json_calls(llama):
    """Llama's format: the answer is the call itself, {"name": ..., "parameters": ...}; `auto` holds it to the
    tools once the answer opens with a brace."""
    url, brace = llama
    for kw, finish in [({"tool_choice": "auto", "logit_bias": {str(brace): 100}}, "tool_calls"),
                       ({"tool_choice": "required"}, "tool_calls"),
                       ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "stop")]:
        whole = ask(url, parallel_tool_calls=False, **kw)
        calls = calls_of(whole)
        assert len(calls) == 1 and whole.finish_reason == finish, kw
        valid(calls)
        streamed = ask(url, stream=True, parallel_tool_calls=False, **kw)
        assert streamed["calls"] == calls and streamed["finish_reason"] == finish


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from pathlib import Path

    from engine.models.presets import make_model
    model_dir = make_model("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3"))
    with openai_serving(str(model_dir), tmp_path_factory.mktemp("tools") / "qwen3.log",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as url:
        yield Url(url, Path(model_dir).name)


def test_reasoning_apart_from_the_answer(qwen3):
    """Thinking on: a thought never closed (max_tokens) is all reasoning, in `reasoning` and `reasoning_content`,
    streamed as delta.reasoning. Thinking off (chat_template_kwargs): the template closes an empty thought, the
    output is the answer, and the tool parser reads it."""
    import openai
    whole = ask(qwen3, tools=None, max_tokens=12)
    extra = whole.message.model_extra
    assert extra["reasoning"] and extra["reasoning"] == extra["reasoning_content"] and not whole.message.content
    c = client(qwen3.url)
    streamed = "".join((chunk.choices[0].delta.model_extra or {}).get("reasoning") or ""
                       for chunk in c.chat.completions.create(model=qwen3.model, messages=ASK, max_tokens=12,
                                                              temperature=0, stream=True))
    assert streamed == extra["reasoning"]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = ask(qwen3, tools=None, max_tokens=12, extra_body=off)
    assert plain.message.content and "reasoning" not in (plain.message.model_extra or {})
    forced = ask(qwen3, tool_choice="required", parallel_tool_calls=False, extra_body=off)
    valid(calls_of(forced))
    assert forced.finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        ask(qwen3, tool_choice="auto")


def test_server_flags_refused_at_start(tiny_dir):
    """--enable-auto-tool-choice needs a parser; `auto` needs a template whose tool format it can tell (the
    trained tokenizer's has no tool section)."""
    import subprocess
    import sys
    for flags, why in [(["--enable-auto-tool-choice"], "enable_auto_tool_choice: needs tool_call_parser"),
                       (["--tool-call-parser", "auto"], "tool_call_parser: auto cannot tell the format")]:
        done = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", tiny_dir, "--port", "0", *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]
