"""Triton kernels against their torch reference ops (interpreted on CPU tensors here, compiled on a GPU), and the
switch that picks them.

Tolerances: fp32 inputs accumulate in fp32 in both implementations and differ only in summation order, so 1e-5.
bf16 inputs are widened to fp32 inside the kernels (exact), accumulate in fp32 and round once on output, so the
kernels are compared with the fp32 reference of the same bf16 inputs at bf16's output rounding: half an ulp is
2^-9 of the value; rtol 2^-7 leaves room for the GPU's tf32 rounding of the softmax weights (2^-11)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import CALLS, reference, select
from tests.helpers import random_ids

triton = pytest.importorskip("triton", reason="triton is not installed (Linux only)")
from engine.kernels import triton_decode, triton_kv, triton_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -9)}
CASES = [pytest.param(dtype, bs, group, id=f"{str(dtype)[6:]}-bs{bs}-gqa{group}")
         for dtype in (torch.float32, torch.bfloat16) for bs in (16, 32) for group in (1, 2, 7)]


def caches(bs: int, nkv: int, hd: int, dtype: torch.dtype, blocks: int = 40):
    g = torch.Generator().manual_seed(bs * 100 + nkv)
    make = lambda: torch.randn(blocks, bs, nkv, hd, generator=g).to(DEVICE, dtype)   # noqa: E731
    return make(), make()


def tables(batch: int, blocks: int, width: int, seed: int) -> torch.Tensor:
    """Random, non-contiguous rows; row 1 repeats one block (a table may name a shared block twice)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(batch)])
    t[1, 1:3] = t[1, 0]
    return t.to(DEVICE)


@pytest.mark.parametrize("dtype,bs,group", CASES)
def test_decode_attention_matches_reference(dtype, bs, group):
    nkv, hd = (1, 12) if group == 7 else (2, 32)            # 12: a head dim that is not a power of two
    k_cache, v_cache = caches(bs, nkv, hd, dtype)
    lens = torch.tensor([1, 37, 7 * bs + 3, 95], device=DEVICE)    # none a multiple of the block size
    table = tables(4, 40, 12, seed=bs + group)
    q = torch.randn(4, group * nkv, hd, generator=torch.Generator().manual_seed(group)).to(DEVICE, dtype)
    want = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, hd ** -0.5)
    for split in (None, 2):                                 # one split for short contexts, and a 2-block split
        got = triton_decode.paged_decode_attention(q, k_cache, v_cache, table, lens, hd ** -0.5, split_blocks=split)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
    # a bound above every length (a CUDA graph's fixed table width): more splits than most rows have blocks
    got = triton_decode.paged_decode_attention(q, k_cache, v_cache, table, lens, hd ** -0.5, max_len=12 * bs)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    bound = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, hd ** -0.5,
                                             max_len=12 * bs)
    torch.testing.assert_close(bound, want)


@pytest.mark.parametrize("dtype,bs,group", CASES)
def test_prefill_attention_matches_reference(dtype, bs, group):
    nkv, hd = (1, 12) if group == 7 else (2, 32)
    k_cache, v_cache = caches(bs, nkv, hd, dtype)
    table = tables(2, 40, 12, seed=group)[1]                # non-contiguous, with a repeated block
    for start, n in ((0, 37), (45, 23)):                    # a cold prompt, and new tokens after a cached prefix
        q = torch.randn(n, group * nkv, hd, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
        want = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, start,
                                                 hd ** -0.5)
        got = triton_prefill.paged_prefill_attention(q, k_cache, v_cache, table, start, hd ** -0.5)
        torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 32])
def test_write_kv_matches_reference(dtype, bs):
    k_cache, v_cache = caches(bs, 2, 32, dtype)
    qkv = torch.randn(5, 3, 2, 32).to(DEVICE, dtype)        # k and v as strided views, as the model makes them
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, bs * 2, bs * 2 + 1, 39 * bs + bs - 1, 0], device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, want_v, slots, k, v)
    triton_kv.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_switch_picks_reference_on_cpu_and_triton_when_asked():
    assert select("auto", "cpu").name == "reference"
    assert select("auto", "cuda").name == "triton"
    assert select("triton", "cpu").paged_decode_attention is triton_decode.paged_decode_attention
    with pytest.raises(ValueError, match="attention"):
        select("flash", "cpu")


@pytest.mark.parametrize("storage_dir", ["tiny", "tiny-odd"])
def test_engine_on_triton_kernels_matches_reference(storage_dir, tiny_dir, odd_dir):
    """Cold and prompt-cache-hit requests, batched, through the engine: same greedy tokens on either switch."""
    path = tiny_dir if storage_dir == "tiny" else odd_dir
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [random_ids(45, seed=1), random_ids(45, seed=1)[:40] + random_ids(9, seed=2), random_ids(20, seed=3)]
    outs = {}
    for attention in ("reference", "triton"):
        llm = LLM(model=path, kv_storage="paged", dtype="float32", block_size=16, attention=attention,
                  device=DEVICE)
        assert llm.engine.runner.ops.name == attention
        before = CALLS[attention]
        first = llm.generate(prompts[0], params)[0]
        rest = llm.generate(prompts[1:], params)
        assert CALLS[attention] > before                      # this implementation served the steps
        assert rest[0].cached_tokens == 32
        outs[attention] = [o.token_ids for o in [first, *rest]]
    assert outs["triton"] == outs["reference"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs for real")
def test_gpu_check_says_it_skips_without_a_gpu():
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "perf" / "gpu_check.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "skipped: no CUDA device" in out.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 20, 40])
def test_sliding_window_attention_matches_reference(dtype, window):
    """Sliding layers: decode over each row's last `window` positions (a window inside one block, across blocks,
    longer than some rows), and prefill where each query sees its own window, after a cached prefix too."""
    bs, nkv, group, hd = 16, 2, 2, 32
    k_cache, v_cache = caches(bs, nkv, hd, dtype)
    lens = torch.tensor([1, 37, 7 * bs + 3, 95], device=DEVICE)
    table = tables(4, 40, 12, seed=window)
    q = torch.randn(4, group * nkv, hd, generator=torch.Generator().manual_seed(window)).to(DEVICE, dtype)
    want = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, hd ** -0.5,
                                            window=window)
    full = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, hd ** -0.5)
    assert not torch.allclose(want[2], full[2])             # the window really cuts the long rows
    for split in (None, 1):
        got = triton_decode.paged_decode_attention(q, k_cache, v_cache, table, lens, hd ** -0.5, window=window,
                                                   split_blocks=split)
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
    for start, n in ((0, 37), (45, 23)):
        q = torch.randn(n, group * nkv, hd, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
        want = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), table[1], start,
                                                 hd ** -0.5, window)
        got = triton_prefill.paged_prefill_attention(q, k_cache, v_cache, table[1], start, hd ** -0.5, window)
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
