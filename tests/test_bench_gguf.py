"""bench-peers' GGUF accuracy line (perf/bench_gguf.agreement): per prompt, how many greedy tokens each engine shares
with transformers loading the same file."""
from __future__ import annotations

import pytest

from engine.kernels import cpu_build
from engine.models.presets import cached_model
from perf import bench_gguf, llama_peer
from tests.test_gguf import write

pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers loads a GGUF through accelerate")
pytestmark = pytest.mark.skipif(cpu_build.library() is None, reason="no CPU kernels here (x86 with AVX2 only)")


def test_agreement_counts_the_tokens_each_engine_shares_with_transformers(tmp_path, monkeypatch, capsys):
    file = write(cached_model("tiny"), tmp_path / "tiny-q8.gguf", "Q8_0")
    seen = []

    class Peer:                                   # llama.cpp's stand-in: transformers' tokens, the 6th changed
        def __init__(self, path, threads):
            assert path == file and threads == 2

        def greedy(self, prompt, tokens):
            seen.append(prompt)
            return [1] * 5 + [0] * (tokens - 5)

        def close(self):
            pass
    monkeypatch.setattr(llama_peer, "Peer", Peer)
    got = bench_gguf.agreement(file, 2, prompts=2, tokens=8)
    assert got["Pagoda float32"] == got["Pagoda int16"] == [8, 8]        # transformers' own tokens
    assert all(0 <= n <= 8 for n in got["Pagoda int8"]) and len(seen) == 2
    assert max(got["llama.cpp"]) <= 5
    out = capsys.readouterr().out
    assert "tiny-q8.gguf: greedy tokens equal to transformers'" in out and "int16 " in out
