"""The scripts in examples/ (which the README and docs/ quote) run as written against the tiny presets, servers
started here; the Triton one runs in tests/test_triton.py, against that module's tritonserver."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def line(out: str, label: str) -> str:
    found = [ln for ln in out.splitlines() if ln.startswith(label)]
    assert found, f"no line starting {label!r} in:\n{out}"
    return found[-1][len(label):].strip()


@pytest.fixture(scope="module")
def openai_url(qwen_tools_url):
    return qwen_tools_url


def test_offline_generation_hits_the_prompt_cache(tiny_dir):
    out = run("offline.py", "--model", tiny_dir)
    cold = re.search(r"cached (\d+)/(\d+) prompt tokens, 16 new tokens", line(out, "cold:"))
    hit = re.search(r"cached (\d+)/(\d+) prompt tokens, 16 new tokens", line(out, "hit:"))
    assert cold and hit and cold[1] == "0" and 0 < int(hit[1]) < int(hit[2]) == int(cold[2])
    assert len(ast.literal_eval(line(out, "first token's top logprobs:"))) >= 2


def test_streaming_ends_with_a_finish_reason(tiny_dir):
    out = run("streaming.py", "--model", tiny_dir)
    tail = re.search(r"\[(\d+) tokens, finish_reason=(length|stop)\]", out)
    assert tail and 0 < int(tail[1]) <= 24 and (tail[2] == "stop" or tail[1] == "24")


def test_openai_chat_whole_equals_streamed(openai_url):
    out = run("openai_chat.py", "--url", openai_url)
    whole = re.match(r"(.*) (stop|length) usage=(\d+)\+(\d+)$", line(out, "whole:"))
    assert whole and int(whole[4]) > 0
    assert ast.literal_eval(line(out, "streamed:")) == ast.literal_eval(whole[1])


def test_openai_tool_round_trip(openai_url):
    out = run("openai_tools.py", "--url", openai_url, "--tool-choice", "required")
    assert line(out, "finish_reason:") == "tool_calls"
    call = re.match(r"get_weather\((\{.*\})\) -> (.*)$", line(out, "call"))
    assert call and set(ast.literal_eval(call[1])) == {"city", "unit"}
    assert isinstance(ast.literal_eval(line(out, "answer:")), str)


def test_structured_output_follows_the_schema(openai_url):
    out = run("structured_output.py", "--url", openai_url)
    person = ast.literal_eval(line(out, "person:").rsplit(" finish_reason:", 1)[0])
    assert set(person) == {"name", "age", "languages"} and 0 <= person["age"] <= 120
    assert ast.literal_eval(line(out, "choice:")) in ("yes", "no", "maybe")
