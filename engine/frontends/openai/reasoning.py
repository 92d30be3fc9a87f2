"""Reasoning text apart from the answer, as vLLM's `qwen3` and `deepseek_r1` reasoning parsers split it: what comes
before </think> is reasoning (the opening <think> may be in the prompt, as Qwen3's and DeepSeek-R1's templates
put it there, or in the output), what follows is the answer. A text with no </think> yet is all reasoning (a
thought cut short by max_tokens stays reasoning), unless the request turned thinking off
(chat_template_kwargs.enable_thinking false), when all of it is the answer."""
from __future__ import annotations

from engine.frontends.openai.tool_parsers import held

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def split(text: str, thinking: bool = True, final: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of the text so far; a trailing partial tag is held back from both until `final`."""
    if not thinking:
        return "", text
    start = text.lstrip()
    if start.startswith(OPEN):
        text = start[len(OPEN):]
    elif not final and held(start, OPEN) == "":
        return "", ""
    end = text.find(CLOSE)
    if end < 0:
        return held(text, CLOSE, final), ""
    return text[:end], text[end + len(CLOSE):].lstrip("\n")
