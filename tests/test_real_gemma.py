"""A real checkpoint: Gemma 3 270M (the registry's Q4_K_M GGUF, dequantized and written by transformers) gives
transformers' greedy tokens (fp32) on a prompt longer than its 512-position sliding window."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from tests.helpers import greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")
pytest.importorskip("accelerate", reason="transformers loads a GGUF through accelerate")


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    from scripts.gemma3_270m import Unavailable, hf_dir
    try:
        return hf_dir()
    except Unavailable as e:
        pytest.skip(f"Gemma 3 270M cannot be had here: {e}")


def test_gemma3_270m_greedy_tokens_equal_transformers(gemma_dir):
    tok = transformers.AutoTokenizer.from_pretrained(gemma_dir)
    corpus = (Path(__file__).parent.parent / "engine" / "models" / "corpus.txt").read_text(encoding="utf-8")
    ids = tok(corpus).input_ids[:600]
    assert ids[0] == tok.bos_token_id and len(ids) > 512
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):]
    del model
    llm = LLM(model=str(gemma_dir), dtype="float32", max_batch_size=2)
    assert llm.engine.runner.windows.count(512) == 15
    got = llm.generate([ids], greedy(8))[0].token_ids
    assert got == want.tolist()
