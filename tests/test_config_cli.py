"""EngineConfig parsing and the `python -m engine` CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import EngineConfig


def test_from_strings():
    c = EngineConfig.from_strings({"max_batch_size": "1", "lookahead": "false", "kv_storage": "dense",
                                   "model": "/m", "block_size": " 16 "})
    assert (c.max_batch_size, c.lookahead, c.kv_storage, c.model, c.block_size) == (1, False, "dense", "/m", 16)
    assert not c.paged
    assert EngineConfig(max_batch_size=2).paged


@pytest.mark.parametrize("values,message", [
    ({"bogus": "1"}, "bogus: unknown engine option"),
    ({"kv_storage": "flat"}, "kv_storage: must be one of auto, paged, dense"),
    ({"max_batch_size": "0"}, "max_batch_size: must be >= 1"),
    ({"block_size": "big"}, "block_size: expected an integer"),
    ({"prompt_cache": "perhaps"}, "prompt_cache: expected a boolean"),
])
def test_bad_options_name_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_strings(values)


def test_cli_make_model_and_generate(tmp_path):
    out = tmp_path / "m"
    run = subprocess.run([sys.executable, "-m", "engine", "make-model", "--preset", "tiny", "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == str(out)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json", "generation_config.json"}
    prompt = "A serving engine reads a prompt, turns it into tokens, and computes the keys and values once. " * 3
    gen = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(out), "--prompt", prompt,
                          "--max-tokens", "5", "--repeat", "2"], capture_output=True, text=True, check=True)
    assert "[run 1]" in gen.stderr and "cached=0/" in gen.stderr
    assert "[run 2]" in gen.stderr and "cached=0/" not in gen.stderr.split("[run 2]")[1]
    assert "prompt-cache: request completed cached=" in gen.stderr
    bad = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(out), "--prompt", "",
                          "--max-tokens", "5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "prompt: must not be empty" in bad.stderr
