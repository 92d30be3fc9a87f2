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
    assert all(0 <= n <= 8 for n in got["Pagoda int8"] + got["Pagoda mixed"]) and len(seen) == 2
    assert max(got["llama.cpp"]) <= 5
    out = capsys.readouterr().out
    assert "tiny-q8.gguf: greedy tokens equal to transformers'" in out and "int16 " in out


def test_rows_name_each_file_and_the_cpu_and_instruction_sets_beside_it(tmp_path, monkeypatch):
    import scripts.gemma3_270m as gemma
    from perf.common import Pair, cpu_model
    file = tmp_path / "f.gguf"
    file.write_bytes(b"\0" * 2**20)

    def no_gemma():
        raise gemma.Unavailable("not here")
    monkeypatch.setattr(gemma, "hf_dir", no_gemma)
    monkeypatch.setattr(llama_peer, "build", lambda: (tmp_path, ""))
    monkeypatch.setattr(llama_peer, "quantized", lambda tree, model, kind, threads: file)
    monkeypatch.setattr(llama_peer, "instruction_sets", lambda: "avx2+avx512")
    monkeypatch.setattr(llama_peer, "compare", lambda *a, **k: (Pair(60.0, 50.0, 1.2, 1.05, 1.3),
                                                                 Pair(500.0, 400.0, 1.25, 0.9, 1.3)))
    monkeypatch.setattr(bench_gguf, "agreement", lambda file, threads: {})
    monkeypatch.setattr(bench_gguf, "resident", lambda file, threads: "")
    rows = bench_gguf.rows((("tiny-qwen", "q8_0"),), 2, 16, 2)
    assert [(r["what"], r["met"]) for r in rows] == [("tiny-qwen q8_0 (1 MiB) decode", False),     # 1.05 < 1.1
                                                      ("tiny-qwen q8_0 512-token prefill", False)]  # 0.9 < 1.0
    assert {(r["cpu"], r["isa"]) for r in rows} == {(cpu_model(), f"{cpu_build.described()} / avx2+avx512")}


def test_the_reference_keeps_llama_3s_rope_scaling_which_transformers_gguf_reader_drops(tmp_path):
    import torch
    import transformers

    from tests.test_gguf import llama
    src = llama(tmp_path)
    file = write(src, tmp_path / "llama.gguf", "F32")
    prompt = torch.tensor([list(range(3, 1000))])         # far past the scaling's 256 original positions
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(prompt).logits
        got = bench_gguf.reference(file)(prompt).logits
        dropped = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file="llama.gguf", dtype=torch.float32, vocab_size=want.shape[-1]).eval()(prompt).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(dropped, want, atol=1e-3)       # what the reader alone gives


def test_bench_qgemm_times_prefills_products_by_method(tmp_path, capsys):
    """perf/bench_qgemm: each method's time over the file's packed projections, int16 where the build has VNNI's
    products (and each other method against it), else only torch's two."""
    from perf import bench_qgemm
    file = write(cached_model("tiny"), tmp_path / "tiny-q8.gguf", "Q8_0")
    times = bench_qgemm.main(["--model", str(file), "--rows", "40", "--repeats", "2"])
    vnni = cpu_build.described().startswith("avx512+vnni")
    assert list(times) == (["int16"] if vnni else []) + ["bf16", "fp32"]
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    out = capsys.readouterr().out
    assert "tiny-q8.gguf:" in out and "GMAC/s" in out and ("over int16" in out) == vnni
