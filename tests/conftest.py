from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter; it must be set before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter checks every integer add, sub and mul for overflow (a compiled kernel checks none unless built
    # for debugging). At the tests' sizes no index nears 2**31, and a wrapped value fails their comparisons anyway;
    # without the checks interpreted kernels run a fifth faster.
    from triton.runtime import interpreter
    interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                  sanitize_overflow=False)

from engine.kernels import cpu_gemv
from engine.models.presets import make_model


def made(tmp_path_factory, preset: str, seed: int = 0) -> str:
    return str(make_model(preset, tmp_path_factory.mktemp(preset), seed=seed))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return made(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def odd_dir(tmp_path_factory) -> str:
    """Odd head counts (7 query heads, 1 KV head) and tied embeddings."""
    return made(tmp_path_factory, "tiny-odd", seed=1)


@pytest.fixture(params=["tiny", "tiny-odd"])
def model_dir(request, tiny_dir, odd_dir) -> str:
    return tiny_dir if request.param == "tiny" else odd_dir


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path_factory.getbasetemp() / "pagoda-cache"))
    monkeypatch.delenv("PAGODA_FORCE_SYNC", raising=False)


@pytest.fixture(scope="session")
def qwen_tiny_dir(tmp_path_factory) -> str:
    """Tiny geometry with Qwen2.5's real tokenizer (151,665 tokens) and chat template."""
    return made(tmp_path_factory, "tiny-qwen")


@pytest.fixture(scope="session")
def qwen_tools_url(qwen_tiny_dir, tmp_path_factory):
    """An OpenAI server on the tiny Qwen with tool calling on (`auto` parser): its host:port."""
    from tests.helpers import openai_serving
    with openai_serving(qwen_tiny_dir, tmp_path_factory.mktemp("tools") / "qwen.log",
                        "--enable-auto-tool-choice", "--tool-call-parser", "auto") as url:
        yield url


@pytest.fixture(scope="module")
def gemv() -> cpu_gemv.CpuGemv:
    """The CPU GEMV kernels on 2 threads, or the test skipped where they cannot run."""
    kernel = cpu_gemv.load(threads=2)
    if kernel is None:
        pytest.skip("no x86 AVX2+FMA CPU or no C++ compiler: torch serves (the other tests here cover that)")
    return kernel
