"""A real checkpoint: Gemma 3 270M, the registry's Q4_K_M GGUF (llama.cpp's file), gives transformers' greedy tokens
(fp32) on a prompt longer than its 512-position sliding window, both loaded straight from the .gguf file and from
the Hugging Face directory transformers writes from it; the file's tokenizer encodes as transformers' does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from tests.helpers import greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")
pytest.importorskip("accelerate", reason="transformers loads a GGUF through accelerate")

CORPUS = Path(__file__).parent.parent / "engine" / "models" / "corpus.txt"


@pytest.fixture(scope="module")
def gemma() -> tuple[Path, Path]:
    """(the .gguf file, the Hugging Face directory transformers made of it)."""
    from scripts.gemma3_270m import Unavailable, hf_dir
    try:
        folder = hf_dir()
    except Unavailable as e:
        pytest.skip(f"Gemma 3 270M cannot be had here: {e}")
    return next(folder.parent.glob("*.gguf")), folder


@pytest.fixture(scope="module")
def reference(gemma) -> tuple[list[int], list[int]]:
    """A 600-token prompt's ids and transformers' 8 greedy tokens after it."""
    tok = transformers.AutoTokenizer.from_pretrained(gemma[1])
    ids = tok(CORPUS.read_text(encoding="utf-8")).input_ids[:600]
    assert ids[0] == tok.bos_token_id and len(ids) > 512
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma[1], dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):]
    return ids, want.tolist()


@pytest.mark.parametrize("source", ["gguf", "directory"])
def test_gemma3_270m_greedy_tokens_equal_transformers(gemma, reference, source):
    ids, want = reference
    llm = LLM(model=str(gemma[0] if source == "gguf" else gemma[1]), dtype="float32", max_batch_size=2)
    assert llm.engine.runner.windows.count(512) == 15
    assert llm.generate([ids], greedy(8))[0].token_ids == want


def test_a_gguf_file_brings_its_tokenizer_and_its_name(gemma):
    from engine.config import EngineConfig
    from engine.tokenizer import Tokenizer
    file, folder = gemma
    tok = transformers.AutoTokenizer.from_pretrained(folder)       # what transformers converted from the file
    ours = Tokenizer(file)
    text = CORPUS.read_text(encoding="utf-8")[:2000]
    assert ours.encode_prompt(text) == tok(text).input_ids and ours.encode_prompt(text)[0] == 2     # BOS
    assert ours.encode(text) == tok(text, add_special_tokens=False).input_ids
    assert ours.stop_ids([1]) == [1] + ([tok.eos_token_id] if tok.eos_token_id != 1 else [])
    assert EngineConfig(model=str(file)).model_name == "gemma-3-270m-q4_k_m"
