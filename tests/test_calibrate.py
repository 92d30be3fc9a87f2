"""Speculation prices its draft rows by what a decode row costs on this machine, timed at load
(engine/runners/torch/calibrate.py)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.core.speculate import Costs
from engine.kernels import cpu_build
from engine.models.presets import cached_model
from engine.runners.torch import calibrate
from engine.runners.torch.runner import TorchRunner

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
kernels = pytest.mark.skipif(cpu_build.library() is None, reason="no C++ CPU kernels here (no AVX2 or no compiler)")


def synthetic(row: float, late: float, cheap: int, asked: list[int], draw: float = 0.0, jump: float = 0.0):
    """Step seconds of a machine that slows by 5% a step (`jump`: what the first row past the cheap ones adds to
    `late`)."""
    def seconds(model, buffers, rows, scale):
        speed = 1 + 0.05 * len(asked)
        asked.append(rows)
        assert len(buffers) >= rows
        past = late * max(rows - cheap, 0) + jump * (rows > cheap)
        return 0.01 * speed * (1 + row * (min(rows, cheap) - 1) + past), 0.01 * speed * draw
    return seconds


def test_row_costs_are_the_timed_steps_against_a_one_row_step(monkeypatch):
    """Steps of 1, cheap, cheap + 1 and 2 x cheap rows (at most the pass's rows): a warm-up, then pairs of rounds,
    forwards and backwards; a row's cost within the cheap rows and past them, in one-row steps, and what a row's
    draw at a temperature adds, each priced by a pair's sums, so a machine whose speed drifts gives the costs it
    would steady; past the cheap rows, the first one's cost where it is dearer than their mean; where the pass takes
    no row past the cheap ones, `late` is `row`; a timing that says rows are free or cost more than a step is
    bounded."""
    asked: list[int] = []
    monkeypatch.setattr(calibrate, "step_seconds", synthetic(0.1, 0.2, 4, asked, draw=0.05))
    args = (None, 2, (1, 4), torch.float32, 1.0)
    assert calibrate.row_costs(*args, cheap=4, most=32) == pytest.approx((0.1, 0.2, 0.05))
    assert asked == [1, 4, 5, 8] + [1, 4, 5, 8, 8, 5, 4, 1] * calibrate.PAIRS
    assert calibrate.row_costs(*args, cheap=4, most=6) == pytest.approx((0.1, 0.2, 0.05))
    assert calibrate.row_costs(*args, cheap=4, most=4) == pytest.approx((0.1, 0.1, 0.05))
    monkeypatch.setattr(calibrate, "step_seconds", synthetic(0.1, 0.1, 4, [], jump=0.3))
    assert calibrate.row_costs(*args, cheap=4, most=32) == pytest.approx((0.1, 0.4, 0.0), abs=1e-9)
    monkeypatch.setattr(calibrate, "step_seconds", synthetic(0.0, 3.0, 4, []))
    assert calibrate.row_costs(*args, cheap=4, most=32) == (0.02, 1.0, 0.0)

class Counting:
    """The model's CPU layers, counting the rows of each call."""

    def __init__(self, stack) -> None:
        self.stack, self.max_rows, self.rows = stack, stack.max_rows, []

    def __call__(self, x, tables, kv):
        self.rows.append(x.shape[0])
        return self.stack(x, tables, kv)


@kernels
@pytest.mark.parametrize("kind", ["fp32", "Q8_0"])
def test_the_engine_prices_rows_by_the_runner_timing(tmp_path, monkeypatch, kind):
    """The runner times decode steps through the model's one-call CPU layers (blocks: 1, 4, 5 and 8 rows; fp32, whose
    pass is its 8 cheap rows: 1 and 8), and the speculator prices its rows by what it measured; a runner without
    those layers times nothing and the defaults stand."""
    if kind == "fp32":
        model, cheap, widths = str(cached_model("tiny")), 8, {1, 8}
    else:
        pytest.importorskip("gguf")
        from tests.test_gguf import write
        model, cheap, widths = str(write(cached_model("tiny"), tmp_path / "tiny-q8.gguf", "Q8_0")), 4, {1, 4, 5, 8}
    runner = LLM(model=model, dtype="float32").engine.runner
    runner.model.stack = counting = Counting(runner.model.stack)
    row, late, sampled = runner.row_costs()
    assert set(counting.rows) == widths and len(counting.rows) == len(widths) * (1 + 2 * calibrate.PAIRS)
    assert 0.02 <= row <= 1.0 and 0.02 <= late <= 1.0 and 0 <= sampled <= 1.0 and (kind != "fp32" or late == row)
    runner.model.stack = None
    assert runner.row_costs() is None
    monkeypatch.setattr(TorchRunner, "row_costs", lambda self: (0.05, 0.07, 0.03))
    spec = LLM(model=model, dtype="float32", speculative_config=SPEC).engine.spec
    assert spec.costs == Costs(cheap, 0.05, 0.07, 0.03)
