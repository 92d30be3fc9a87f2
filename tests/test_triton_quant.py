"""The Triton block kernels (kernels/triton_quant.py; interpreted on CPU tensors here, compiled on a GPU) against
gguf-py's dequantization followed by a float matmul, and against the CPU block kernels on the same bytes.

Tolerances: the GEMV's fp32 sums differ from the exact product of the dequantized weights only in rounding, within
k ulps of the sum of |terms| whatever the order; the CPU kernel (fp32 activations) meets the same bound, so the two
are within twice it. Dequantized weights are gguf-py's bit for bit where interpreted (numpy, the same products in
the same order); a GPU may fuse a multiply-add, one rounding fewer, so there they are within an ulp of the terms.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import cpu_quant
from engine.models import quant
from engine.models.quant import QLinear

triton = pytest.importorskip("triton", reason="triton is not installed (Linux only)")
gguf = pytest.importorskip("gguf")
from engine.kernels import triton_quant  # noqa: E402
from tests.test_cpu_quant import blocks, dense  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = dict(rtol=0, atol=0) if os.environ.get("TRITON_INTERPRET") == "1" else dict(rtol=1e-6, atol=1e-5)
CASES = [pytest.param(m, dtype, id=f"m{m}-{str(dtype)[6:]}") for m, dtype in
         ((1, torch.float32), (3, torch.bfloat16), (8, torch.float32))]


def on_device(parts: list) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """QLinear's data for `parts`: the bytes one after another (on the device) and (type, rows, row_bytes)."""
    data = torch.cat([p.data.reshape(-1) for p in parts]).to(DEVICE)
    return data, [(p.type, p.rows, p.data.shape[1]) for p in parts]


def within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           ulps: float = 1.0) -> bool:
    """got equals x @ w.T (+ bias) within fp32 summation's bound: k ulps of the sum of |terms|."""
    x, w = x.double(), w.double()
    want = x @ w.T + (0 if bias is None else bias.double())
    bound = ulps * w.shape[1] * 2.0 ** -24 * (x.abs() @ w.abs().T + (0 if bias is None else bias.double().abs()))
    return bool(((got.cpu().double() - want).abs() <= bound).all())


@pytest.mark.parametrize("kind", list(cpu_quant.TYPES))
@pytest.mark.parametrize("m,dtype", CASES)
def test_the_gemv_is_the_float_product_of_the_dequantized_blocks(kind, m, dtype):
    """Against gguf's dequantize and an fp32 matmul, and against the CPU kernel with x in fp32 (no int8) where it
    builds; bf16 activations are widened, so the product is that of their fp32 values."""
    b = blocks(kind, 37, 512, seed=2)
    data, kinds = on_device([b])
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = triton_quant.gemv(x.to(DEVICE), data, kinds, (37, 512))
    assert got.shape == (m, 37) and got.dtype == torch.float32
    assert within(got, x.float(), dense(b))
    cpu = cpu_quant.load()
    if cpu is not None:
        q = QLinear([b], None, cpu)
        q.int8 = False
        assert within(got, x.float(), dense(b), ulps=2) and within(q.forward(x.float()), x.float(), dense(b))


@pytest.mark.parametrize("kind", list(cpu_quant.TYPES))
def test_dequantized_rows_are_ggufs(kind):
    b = blocks(kind, 11, 512, seed=3)
    data, kinds = on_device([b])
    torch.testing.assert_close(triton_quant.dequant(data, kinds, 512, 2, 7).cpu(), dense(b)[2:9], **EXACT)
    ids = torch.tensor([10, 0, 3, 3])
    torch.testing.assert_close(triton_quant.take(data, kinds, 512, ids.to(DEVICE)).cpu(), dense(b)[ids], **EXACT)
    half = triton_quant.dequant(data, kinds, 512, 0, 11, torch.bfloat16).cpu()
    assert half.dtype == torch.bfloat16
    # within a bf16 ulp: a GPU narrows to nearest, the interpreter (Triton 3.x) truncates
    torch.testing.assert_close(half.float(), dense(b).bfloat16().float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("names,rows,k", [(("Q4_K", "Q4_K", "Q6_K"), (12, 3, 6), 256),
                                          (("Q5_0", "F32", "Q8_0"), (3, 12, 6), 96)], ids=["q4_k_m", "odd"])
def test_a_projection_of_mixed_parts_through_qlinear(names, rows, k, monkeypatch):
    """A fused projection as Q4_K_M stores one (q and k in Q4_K, v in Q6_K), and one whose k is not a whole chunk
    with an F32 part starting 2 bytes off a multiple of 4 (3 rows of Q5_0 at k = 96: 3 x 66 bytes): QLinear with
    `triton` set, decode's rows, prefill's slices (cut to straddle the parts) and an embedding's rows."""
    parts = [blocks(name, r, k, seed=10 + i) for i, (name, r) in enumerate(zip(names, rows))]
    w = torch.cat([dense(p) for p in parts])
    bias = torch.randn(21)
    q = QLinear(parts, bias, None)
    q.triton = True
    q.to(DEVICE)
    x = torch.randn(4, k)
    assert within(q.forward(x.to(DEVICE)), x, w, bias)
    monkeypatch.setattr(quant, "SLICE_BYTES", 4 * k * 5)        # slices of 5 rows
    big = torch.randn(quant.MAX_ROWS + 3, k)
    assert within(q.forward(big.to(DEVICE)), big, w, bias)
    ids = torch.tensor([[20, 0], [12, 14]])
    torch.testing.assert_close(q.rows(ids.to(DEVICE)).cpu(), w[ids], **EXACT)


def test_a_part_it_cannot_read_is_refused():
    data = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="GGML type 3"):
        triton_quant.gemv(torch.zeros(1, 32, device=DEVICE), data, [(3, 2, 32)], (2, 32))
    with pytest.raises(ValueError, match="packed"):
        triton_quant.gemv(torch.zeros(1, 32, device=DEVICE), data, [(8, 1, 34, 34, 1)], (1, 32))


def test_a_gguf_model_decodes_through_the_triton_kernels(tmp_path):
    """A Q8_0 GGUF file (its embedding and head in blocks too) greedy-decodes transformers' tokens on the same
    weights dequantized: on a GPU loaded there (the blocks on the device), here with every QLinear's `triton` set
    and the CPU's fused decode layers off, so each projection, the embedding and the head go through the kernels."""
    pytest.importorskip("transformers.integrations.gguf.reader",
                        reason="this transformers cannot read GGUF metadata (5.24 can; a GPU image may be older)")
    from engine import LLM
    from engine.models.presets import cached_model
    from tests.helpers import greedy, random_ids
    from tests.test_gguf import write
    from tests.test_quantized_models import reference
    src = cached_model("tiny")
    file = write(src, tmp_path / "tiny-q8.gguf", "Q8_0")
    llm = LLM(model=str(file), device=DEVICE, max_batch_size=1, quantized_activations="float32")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QLinear)]
    assert model.embed.weight in layers and all(q.blocks.device.type == DEVICE for q in layers)
    if DEVICE == "cpu":
        model.use_gemv(None)
        model.use_kernels(None, None)
        for q in layers:
            q.triton = True
    prompt = random_ids(24, seed=5)
    assert llm.generate(prompt, greedy(8))[0].token_ids == reference(src, prompt, {"proj": "Q8_0", "embed": "Q8_0"}, 8)
