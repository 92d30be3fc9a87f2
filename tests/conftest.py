from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter; it must be set before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.models.presets import make_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def odd_dir(tmp_path_factory) -> str:
    """Odd head counts (7 query heads, 1 KV head) and tied embeddings."""
    return str(make_model("tiny-odd", tmp_path_factory.mktemp("tiny-odd"), seed=1))


@pytest.fixture(params=["tiny", "tiny-odd"])
def model_dir(request, tiny_dir, odd_dir) -> str:
    return tiny_dir if request.param == "tiny" else odd_dir


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path_factory.getbasetemp() / "pagoda-cache"))
    monkeypatch.delenv("PAGODA_FORCE_SYNC", raising=False)
