"""Paged decode attention (cpu_attention.cpp) on a speculative step's rows: a sequence's rows share one block table
and attend over consecutive lengths. Each row must get what the reference gives it, and, bit for bit, what it gets
alone and on any number of threads: greedy decoding with speculation equals decoding without only if a row's
attention does not depend on the rows beside it."""
from __future__ import annotations

import ctypes

import pytest
import torch

from engine.kernels import cpu_attention, cpu_build, reference
from tests.helpers import ULP
from tests.test_cpu_gemv_isa import runnable


def sequence(rows: int, ctx: int, nh: int, n_kv: int, hd: int, bs: int, dtype: torch.dtype, seed: int,
             others: int = 0):
    """A sequence of ctx cached positions and its next `rows` rows (one block table, consecutive positions), then
    `others` one-row sequences of their own blocks: (q, k, v, k_cache, v_cache, slots, tables, seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-(ctx + rows) // bs)
    blocks = width * (1 + others)
    k_cache, v_cache = torch.randn(2, blocks, bs, n_kv, hd, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g)
    tables = [order[:width]] * rows + [order[width * (i + 1):width * (i + 2)] for i in range(others)]
    lens = [ctx + 1 + r for r in range(rows)] + [ctx - 3 * i for i in range(others)]
    slots = [int(t[(n - 1) // bs]) * bs + (n - 1) % bs for t, n in zip(tables, lens)]
    b = rows + others
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((b, nh, hd), (b, n_kv, hd), (b, n_kv, hd)))
    return q, k, v, k_cache, v_cache, torch.tensor(slots), torch.stack(tables), torch.tensor(lens)


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def kernels(request):
    """The kernels of each build this CPU runs, on 1 and 2 threads."""
    if not runnable(request.param, []):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    try:
        lib = ctypes.CDLL(str(cpu_build.build(request.param)))
    except RuntimeError as e:
        pytest.skip(f"no build: {e}")
    return cpu_attention.CpuDecode(lib, threads=1), cpu_attention.CpuDecode(lib, threads=2)


@pytest.mark.parametrize("nh,n_kv,hd,bs", [(4, 1, 256, 32), (14, 2, 64, 16), (8, 8, 128, 32), (6, 2, 40, 8)])
@pytest.mark.parametrize("ctx", [5, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 100])
def test_a_sequences_rows_attend_as_the_reference_and_as_each_alone(kernels, nh, n_kv, hd, bs, ctx, dtype, window):
    """Gemma 3's geometry, Qwen2.5 0.5B's (7 query heads a KV head), one KV head a query head, and a head size
    the vector loops do not divide (40); a context within a block and one of many, windows inside it; two other
    sequences beside it."""
    one, two = kernels
    rows = 5
    q, k, v, k_cache, v_cache, slots, tables, lens = sequence(rows, ctx, nh, n_kv, hd, bs, dtype, seed=ctx + hd,
                                                              others=2)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, want_v, slots, k, v)
    want = reference.paged_decode_attention(q.float(), want_k.float(), want_v.float(), tables, lens, 0.3,
                                            window=window)
    got = two(q, k, v, k_cache, v_cache, slots, tables, lens, 0.3, window)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else ULP
    torch.testing.assert_close(got.float(), want, **tol)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(one(q, k, v, k_cache, v_cache, slots, tables, lens, 0.3, window), got)   # threads
    for r in range(rows + 2):              # each row alone (the caches hold every row's K/V already)
        alone = two(q[r:r + 1], k[r:r + 1], v[r:r + 1], k_cache, v_cache, slots[r:r + 1], tables[r:r + 1],
                    lens[r:r + 1], 0.3, window)
        assert torch.equal(alone, got[r:r + 1]), f"row {r}"
