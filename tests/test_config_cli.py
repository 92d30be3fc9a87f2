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


def test_every_field_has_a_flag_with_help_and_choices():
    import argparse
    from dataclasses import fields

    from engine.config import ServeConfig, add_flags
    for cls in (EngineConfig, ServeConfig):
        parser = argparse.ArgumentParser()
        add_flags(parser, cls)
        actions = {a.dest: a for a in parser._actions}
        for f in fields(cls):
            action = actions[f.name]
            assert action.option_strings == [f"--{f.name.replace('_', '-')}"] and f.metadata["help"] in action.help
            assert tuple(action.choices or ()) == tuple(c for c in f.metadata["choices"] if c is not None)
    # a boolean flag alone means true, as vLLM's store_true flags (--enable-auto-tool-choice)
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    assert parser.parse_args(["--enable-auto-tool-choice"]).enable_auto_tool_choice is True
    assert parser.parse_args(["--enable-auto-tool-choice", "false"]).enable_auto_tool_choice == "false"


def test_flags_over_env_over_defaults():
    import argparse

    from engine.config import add_flags, from_flags
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    env = {"PAGODA_MAX_BATCH_SIZE": "2", "PAGODA_KV_STORAGE": "dense", "PAGODA_UNRELATED": "x"}
    c = from_flags(EngineConfig, parser.parse_args(["--kv-storage", "paged", "--lookahead", "off"]), env)
    assert (c.max_batch_size, c.kv_storage, c.lookahead, c.block_size) == (2, "paged", False, 32)
    with pytest.raises(ValueError, match="lookahead: expected a boolean"):
        from_flags(EngineConfig, parser.parse_args(["--lookahead", "perhaps"]), {})
    with pytest.raises(SystemExit):                           # choices come from the field: argparse refuses
        parser.parse_args(["--kv-storage", "flat"])


def test_llm_keywords_over_env_and_unknown_names(tiny_dir, monkeypatch):
    from engine import LLM
    from engine.config import from_kwargs
    monkeypatch.setenv("PAGODA_MAX_BATCH_SIZE", "1")
    assert from_kwargs(EngineConfig, {"model": tiny_dir}).max_batch_size == 1
    assert from_kwargs(EngineConfig, {"model": tiny_dir, "max_batch_size": 3}).max_batch_size == 3
    with pytest.raises(ValueError, match="max_batch_sise: unknown engine option"):
        LLM(model=tiny_dir, max_batch_sise=2)
    assert not LLM(model=tiny_dir, dtype="float32").engine.config.paged        # PAGODA_MAX_BATCH_SIZE=1: dense


def test_pbtxt_parameters_are_overridden_by_env():
    c = EngineConfig.from_sources({"max_batch_size": "4", "lookahead": "true"}, {"PAGODA_LOOKAHEAD": "0"})
    assert c.max_batch_size == 4 and c.lookahead is False


def test_serve_options_from_env(monkeypatch):
    import argparse

    from engine.config import ServeConfig, add_flags, from_flags
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    env = {"PAGODA_API_KEY": "k", "PAGODA_MAX_BODY_BYTES": "1024"}
    s = from_flags(ServeConfig, parser.parse_args(["--port", "9000"]), env)
    assert (s.host, s.port, s.api_key, s.max_body_bytes) == ("127.0.0.1", 9000, "k", 1024)
    with pytest.raises(ValueError, match="max_body_bytes: must be >= 1"):
        from_flags(ServeConfig, parser.parse_args(["--max-body-bytes", "0"]), {})


def test_process_wide_switches(monkeypatch, tmp_path):
    from engine import config
    monkeypatch.setenv("PAGODA_FORCE_SYNC", "1")
    assert config.force_sync() and not EngineConfig(lookahead=True).use_lookahead
    monkeypatch.setenv("PAGODA_FORCE_SYNC", "0")
    assert EngineConfig(lookahead=True).use_lookahead
    monkeypatch.setenv("PAGODA_FAILPOINT_STEPS", "3, 7")
    assert EngineConfig().failpoints == {3, 7}
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    assert config.cache_root() == tmp_path


def test_no_pagoda_variable_is_read_outside_config():
    """Every PAGODA_* variable is read in engine/config.py and nowhere else."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    reads = re.compile(r"environ(\.get)?[\[(]\s*[\"']PAGODA_|getenv\(\s*[\"']PAGODA_")
    for folder in ("engine", "client", "perf", "scripts", "model_repository"):
        for path in (root / folder).rglob("*.py"):
            if path != root / "engine" / "config.py":
                assert not reads.search(path.read_text(encoding="utf-8")), path
