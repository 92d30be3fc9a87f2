"""GGUF files on MLX (models/quant_mlx.py): Q8_0, Q4_0, Q5_0 and Q4_K convert into MLX's (w, scales, biases) that
dequantize to gguf-py's own fp32 weights bit for bit, and a file of them loads into quantized matmuls that decode the
greedy tokens of the same weights in float (transformers on a Q8_0 file; a mixed file dequantized at load by MLX
itself); Q6_K falls back to float."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from engine.models.presets import cached_model
from engine.runners.base import Row
from tests.helpers import greedy, random_ids
from tests.test_cpu_quant import blocks, dense
from tests.test_gguf import copy_metadata, rounded, write

mx = pytest.importorskip("mlx.core")
gguf = pytest.importorskip("gguf")

from engine.models import quant_mlx  # noqa: E402
from engine.models.decoder_mlx import load_mlx  # noqa: E402
from engine.runners.mlx import attention as mlx_attention  # noqa: E402

BITS = {"Q8_0": 8, "Q4_0": 4, "Q5_0": 5, "Q4_K": 4}


@pytest.mark.parametrize("kind", list(BITS))
def test_exact_types_dequantize_as_gguf_does_bit_for_bit(kind):
    b = blocks(kind, 9, 512, seed=1)
    q = quant_mlx.convert(b, mx.float32)
    assert q.bits == BITS[kind] and q.scales.shape == (9, 16)
    want = dense(b).numpy()
    assert np.array_equal(np.array(mx.dequantize(*q, group_size=32, bits=q.bits)), want)
    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    got = np.array(quant_mlx.matmul(mx.array(x), q)).astype(np.float64)
    # within fp32 summation's bound: k ulps of the sum of |terms|
    bound = 512 * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(want.T))
    assert (np.abs(got - x.astype(np.float64) @ want.T) <= bound).all()


@pytest.mark.parametrize("kind", list(BITS))
@pytest.mark.parametrize("dtype,u", [("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)])
def test_scales_in_a_half_dtype_are_off_by_their_rounding(kind, dtype, u):
    """A GPU keeps scales and biases in the model dtype: the weights they stand for (taken exactly) differ from gguf's
    by at most the dtype's unit roundoff of |scale q| + |bias| (Q8_0, Q4_0, Q5_0: of the weight itself)."""
    b = blocks(kind, 9, 512, seed=3)
    exact, half = quant_mlx.convert(b, mx.float32), quant_mlx.convert(b, getattr(mx, dtype))
    ones = mx.ones(exact.scales.shape)
    q = np.array(mx.dequantize(exact.w, ones, mx.zeros(ones.shape), group_size=32, bits=exact.bits), np.float64)
    f64 = lambda a: np.repeat(np.array(a.astype(mx.float32), np.float64), 32, axis=1)   # noqa: E731
    scale_q, bias = f64(exact.scales) * q, f64(exact.biases)
    assert np.array_equal((scale_q + bias).astype(np.float32), dense(b).numpy())    # one rounding, as gguf-py's
    err = np.abs(f64(half.scales) * q + f64(half.biases) - (scale_q + bias))
    assert (err <= u * (np.abs(scale_q) + np.abs(bias))).all()
    if kind != "Q4_K":
        assert (err <= u * np.abs(scale_q + bias)).all()


def test_q6_k_is_not_an_mlx_group_and_stays_float():
    assert quant_mlx.convert(blocks("Q6_K", 4, 256, seed=4), mx.float32) is None


def test_a_q8_0_file_decodes_as_transformers_on_its_rounded_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = cached_model("tiny")
    file = write(src, tmp_path / "tiny-q8.gguf", "Q8_0")
    model = load_mlx(file, "float32")
    layer = model.layers[0]
    assert all(isinstance(w, quant_mlx.Quantized) and w.bits == 8
               for w in (model.head, model.embed, layer.qkv_w, layer.o_w, layer.gate_up, layer.down))
    prompt = random_ids(40, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(rounded(p.numpy(), "Q8_0")))
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    got = LLM(model=str(file), runner="mlx", dtype="float32").generate(prompt, greedy(12))[0].token_ids
    assert got == want[0, len(prompt):].tolist()


# the mixed file: per tensor, its type (a Q4_K_M-like mix; "v"/"down" alternate by layer, as Q4_K_M's do)
KINDS = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": ("Q6_K", "Q4_K"), "attn_output": "Q5_0",
         "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": ("Q6_K", "Q4_K")}


def k_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes whose weights are of a model's size and about zero-mean (gguf-py has no K-quant
    quantizer)."""
    qt = gguf.GGMLQuantizationType[kind]
    size, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (shape[0], shape[1] // size, nbytes), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-4, raw.shape[:2]).astype(np.float16)
    if kind == "Q4_K":       # w = d sc q - dmin m: each min equal to its scale, and dmin = 7.5 d, centre q's range
        raw[..., 0:4] = np.stack([d, (7.5 * d).astype(np.float16)], axis=-1).view(np.uint8)
        raw[..., 8:12] = raw[..., 4:8]
        raw[..., 12:16] = (raw[..., 12:16] & 15) * np.uint8(17)
    else:                    # Q6_K: w = d sc (q - 32), d last
        raw[..., 208:210] = (d / 4).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def mixed(tmp_path: Path) -> Path:
    """The `small` preset (tied embedding, widths of 256 and 768) as a GGUF file of mixed block types."""
    f32, out = write(cached_model("small"), tmp_path / "small.gguf"), tmp_path / "mixed.gguf"
    reader, rng = gguf.GGUFReader(str(f32)), np.random.default_rng(0)
    w = gguf.GGUFWriter(str(out), "qwen2")
    copy_metadata(reader, w)
    for t in reader.tensors:
        parts = t.name.split(".")
        kind = KINDS.get(parts[0] if len(parts) == 2 else parts[2]) if parts[-1] == "weight" else None
        array = np.asarray(t.data)
        if isinstance(kind, tuple):
            kind = kind[int(parts[1]) % 2]
        if kind is None:
            w.add_tensor(t.name, array)
            continue
        qt = gguf.GGMLQuantizationType[kind]
        raw = k_blocks(kind, array.shape, rng) if kind.endswith("_K") else gguf.quantize(array, qt)
        w.add_tensor(t.name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def logits(model, ids: list[int]) -> np.ndarray:
    """Prefill of all but the last 4 tokens, then one token a step (the compiled decode path); the hidden states
    stay in the model dtype."""
    cfg = model.cfg
    flat = (len(ids), cfg.num_key_value_heads, cfg.head_dim)
    k = [mx.zeros(flat, dtype=model.dtype) for _ in range(cfg.num_hidden_layers)]
    v = [mx.zeros(flat, dtype=model.dtype) for _ in range(cfg.num_hidden_layers)]
    out = []
    for start, end in [(0, len(ids) - 4)] + [(p, p + 1) for p in range(len(ids) - 4, len(ids))]:
        row = Row(0, start, ids[start:end], slots=list(range(start, end)), block_table=[0])
        hidden = model.forward(mx.array(ids[start:end]), mx.arange(start, end),
                               mlx_attention.paged(k, v, len(ids), [row], cfg.head_dim ** -0.5))
        assert hidden.dtype == model.dtype
        out.append(np.array(model.logits(hidden)))
    return np.concatenate(out)


def test_a_mixed_file_runs_quantized_matmuls_and_decodes_as_its_dequantized_weights(tmp_path, monkeypatch):
    file = mixed(tmp_path)
    model = load_mlx(file, "float32")
    Q, first, second = quant_mlx.Quantized, model.layers[0], model.layers[1]
    assert isinstance(model.head, Q) and model.embed is model.head and model.head.bits == 4   # tied Q4_K
    assert [type(p) for p in first.qkv_w] == [Q, mx.array] and first.qkv_w[0].w.shape[0] == 256 + 128
    assert isinstance(second.qkv_w, Q) and second.qkv_w.w.shape[0] == 256 + 2 * 128      # v in Q4_K: fused
    assert first.o_w.bits == 5 and [p.bits for p in first.gate_up] == [4, 8]
    assert isinstance(first.down, mx.array) and second.down.bits == 4                   # Q6_K: float
    ids = random_ids(24, seed=7)
    got, half = logits(model, ids), load_mlx(file, "bfloat16")
    assert half.head.scales.dtype == (mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)
    got_half = logits(half, ids)
    monkeypatch.setattr(quant_mlx, "convert", lambda b, dtype: None)       # every block type dequantized at load
    want = logits(load_mlx(file, "float32"), ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()           # the same weights, summed in another order
    assert np.abs(got_half - want).max() <= 2e-2 * np.abs(want).max()      # bf16 activations
    prompts = [random_ids(30, seed=8), random_ids(17, seed=9)]
    reference = LLM(model=str(file), runner="mlx", dtype="float32").generate(prompts, greedy(10))
    monkeypatch.undo()
    quantized = LLM(model=str(file), runner="mlx", dtype="float32").generate(prompts, greedy(10))
    assert [o.token_ids for o in quantized] == [o.token_ids for o in reference]
