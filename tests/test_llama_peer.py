"""bench-peers' llama.cpp rows without building llama.cpp: the pairing arithmetic, and the rows left out, with the
reason, when llama-cpp-python cannot be built."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.kernels import cpu_build
from perf import bench_peers, llama_peer
from perf.common import Pair, cpu_model


def test_a_peer_that_cannot_be_built_leaves_its_rows_out_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_peer.sys, "executable", str(tmp_path / "no-such-python"))    # the venv cannot be made
    tree, why = llama_peer.build()
    assert tree is None and why.startswith(f"llama-cpp-python {llama_peer.VERSION} could not be built: ")
    assert "no-such-python" in why
    assert not any(llama_peer.home().glob(".built*"))          # a later run tries again
    assert bench_peers.llama_cpp_rows("tiny-qwen", 1, 4, 2) == []
    assert f"llama.cpp rows left out: {why}" in capsys.readouterr().out


class FakePeer:
    """llama.cpp's side: TTFT 0.5 s, then tokens 0.1 s apart; records what it was asked."""
    asked: list[tuple[list[int], int]] = []
    closed = False

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024) -> None:
        assert path == Path("model.gguf") and threads == 2 and n_ctx >= 512

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
        FakePeer.asked.append((prompt, tokens))
        return 0.5, [0.5 + 0.1 * i for i in range(tokens)]

    def close(self) -> None:
        FakePeer.closed = True


def test_compare_alternates_abba_with_the_same_prompts_and_rates_prefill_by_ttft(tiny_dir, monkeypatch):
    ours: list[tuple[list[int], int]] = []
    rates = iter([20.0, 5.0, 30.0, 15.0])                 # decode: 2x, 0.5x, 3x, 1.5x llama.cpp's 10 tok/s

    def fake_run(engine, prompt, tokens):
        ours.append((prompt, tokens))
        if len(ours) == 1:
            return 1.0, 1.0                               # warm-up
        return (0.25, float("nan")) if tokens == 1 else (1.0, next(rates))
    order = []
    monkeypatch.setattr(llama_peer, "Peer", FakePeer)
    monkeypatch.setattr(llama_peer, "gguf", lambda tree, model, dtype: Path("model.gguf"))
    monkeypatch.setattr(llama_peer, "greedy_run", lambda *a: order.append("pagoda") or fake_run(*a))
    real_run = FakePeer.run
    monkeypatch.setattr(FakePeer, "run", lambda self, *a: order.append("llama") or real_run(self, *a))
    FakePeer.asked, FakePeer.closed = [], False
    decode, prefill = llama_peer.compare(Path("tree"), Path(tiny_dir), "float32", 2, 4, 4)
    assert order[:2] == ["pagoda", "llama"]                                           # warm-up
    assert order[2:10] == ["pagoda", "llama", "llama", "pagoda"] * 2                   # decode, ABBA
    assert order[10:] == ["pagoda", "llama", "llama", "pagoda"] * 2                    # prefill, ABBA
    assert [p for p, _ in ours] == [p for p, _ in FakePeer.asked]                     # the same prompts, in turn
    assert len({tuple(p) for p, _ in ours}) == len(ours)                              # fresh ones: no cached prefix
    assert [len(p) for p, n in ours[-4:]] == [512] * 4 and all(n == 1 for _, n in ours[-4:])
    assert decode == pytest.approx(Pair(17.5, 10.0, 1.75, 0.5, 3.0))    # per-pair ratios 2, 0.5, 3, 1.5
    assert prefill == pytest.approx(Pair(2048.0, 1024.0, 2.0, 2.0, 2.0))  # 512 / 0.25 s against 512 / 0.5 s
    assert FakePeer.closed


def test_rows_name_dtype_and_measure_against_their_goals(monkeypatch):
    monkeypatch.setattr(llama_peer, "build", lambda: (Path("tree"), ""))
    monkeypatch.setattr(bench_peers, "cached_model", lambda preset: Path(preset))
    monkeypatch.setattr(llama_peer, "instruction_sets", lambda: "avx2+avx512")
    pairs = {"float32": (Pair(10.5, 10.0, 1.05), Pair(900.0, 1000.0, 0.9)),
             "bfloat16": (Pair(20.0, 16.0, 1.25), Pair(1200.0, 1000.0, 1.2))}
    dense = {"float32": Pair(9.0, 10.0, 0.9), "bfloat16": Pair(17.0, 16.0, 1.06)}

    def compare(tree, model, dtype, *a, prefill=512, config=None):
        if config == {"max_batch_size": 1}:          # dense KV: decode only
            assert prefill == 0
            return dense[dtype], None
        assert config is None
        return pairs[dtype]
    monkeypatch.setattr(llama_peer, "compare", compare)
    rows = bench_peers.llama_cpp_rows("qwen2.5-0.5b", 2, 128, 4)
    got = [(r["what"], r["ratio"], r["goal"], r["met"]) for r in rows]
    assert got == [("qwen2.5-0.5b fp32 decode, paged KV", 1.05, 1.1, False),
                   ("qwen2.5-0.5b fp32 decode, dense KV", 0.9, 1.1, False),
                   ("qwen2.5-0.5b fp32 512-token prefill", 0.9, 1.0, False),
                   ("qwen2.5-0.5b bf16 decode, paged KV", 1.25, 1.0, True),
                   ("qwen2.5-0.5b bf16 decode, dense KV", 1.06, 1.0, True),
                   ("qwen2.5-0.5b bf16 512-token prefill", 1.2, 1.0, True)]
    assert {r["section"] for r in rows} == {"vs llama.cpp"}
    assert {r["isa"] for r in rows} == {f"{cpu_build.described()} / avx2+avx512"}     # printed beside each row
    assert {r["cpu"] for r in rows} == {cpu_model()}


def test_llama_cpp_names_its_instruction_sets_from_its_system_info(monkeypatch):
    info = ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 0 | AVX512_BF16 = 1 | "
            "REPACK = 1 |")
    monkeypatch.setattr(llama_peer.subprocess, "run", lambda *a, **kw: SimpleNamespace(stdout=info))
    assert llama_peer.instruction_sets() == "avx+avx2+avx512+avx512_bf16"
    monkeypatch.setattr(llama_peer.subprocess, "run", lambda *a, **kw: SimpleNamespace(stdout=""))
    assert llama_peer.instruction_sets() == "?"
