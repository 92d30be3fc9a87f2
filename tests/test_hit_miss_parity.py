"""The promise, checked structurally: a decode tick after a prompt-cache hit issues exactly the same tensor ops,
with the same shapes, as one after a miss at the same sequence length, on paged and dense storage."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.kernels import cpu_attention, cpu_gemv, cpu_layers, cpu_pointwise
from tests.conftest import made
from tests.helpers import random_ids


def shapes(args) -> tuple:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)


class OpLog(TorchDispatchMode):
    active: OpLog | None = None           # the log the C kernels' calls go to (see log_kernels)

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), shapes(args)))
        return func(*args, **(kwargs or {}))


KERNELS = [(cpu_gemv.CpuGemv, "__call__"), (cpu_gemv.CpuGemv, "fused"), (cpu_attention.CpuDecode, "__call__"),
           (cpu_pointwise.CpuPointwise, "rms_norm"), (cpu_pointwise.CpuPointwise, "rope"),
           (cpu_pointwise.CpuPointwise, "norm_heads"),
           (cpu_layers.CpuLayers, "__call__")]


@pytest.fixture(autouse=True)
def log_kernels(monkeypatch):
    """The CPU kernels run outside torch's dispatcher: their calls go into the active log too."""
    for cls, name in KERNELS:
        def logged(self, *args, _real=getattr(cls, name), _name=f"{cls.__name__}.{name}", **kwargs):
            if OpLog.active is not None:
                OpLog.active.ops.append((_name, shapes(args) + shapes(kwargs.values())))
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, logged)


def decode_tick_ops(llm: LLM, prompt: list[int], at: int) -> tuple[list[tuple], int]:
    """Ops of the decode tick that launches position `at`, and the request's cached tokens."""
    eng = llm.engine
    req = eng.add(eng.make_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    log = None
    while eng.has_work:
        if req.num_allocated == at and log is None and not req.prefilling:
            log = OpLog.active = OpLog()
            with log:
                eng.step()
            OpLog.active = None
        else:
            eng.step()
    assert log is not None
    return log.ops, req.num_cached


@pytest.fixture(scope="module", params=["tiny", "tiny-gemma3"])
def family_dir(request, tmp_path_factory, tiny_dir) -> str:
    """Qwen2, and Gemma 3: sliding layers (window 48, shorter than the prompts), two RoPEs, four norms a layer."""
    return tiny_dir if request.param == "tiny" else made(tmp_path_factory, request.param)


@pytest.mark.parametrize("storage,batch", [("paged", 4), ("dense", 1)])
def test_decode_tick_is_identical_after_hit_and_miss(family_dir, storage, batch):
    llm = LLM(model=family_dir, dtype="float32", kv_storage=storage, max_batch_size=batch)
    llm.generate(random_ids(100, seed=1), SamplingParams(max_tokens=4, temperature=0))       # warm-up
    miss = random_ids(100, seed=2)
    hit = miss[:77] + random_ids(23, seed=3)
    miss_ops, miss_cached = decode_tick_ops(llm, miss, at=105)
    hit_ops, hit_cached = decode_tick_ops(llm, hit, at=105)
    assert miss_cached == 0 and hit_cached == (64 if storage == "paged" else 77)
    assert len(miss_ops) > 20             # the tick was logged (CPU decode: its layers are one call)
    model = llm.engine.runner.model
    if model.layers[0].kernels is not None:         # fused CPU decode: its calls logged too
        fused, stack = (sum(op[0] == name for op in miss_ops) for name in ("CpuGemv.fused", "CpuLayers.__call__"))
        assert (fused, stack) == (0, 1)             # every layer in one call, paged or dense
    assert hit_ops == miss_ops

