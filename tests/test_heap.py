"""heap.keep: a CPU step's large buffers come back from the heap instead of a fresh mapping each step."""
import subprocess
import sys

import pytest

from engine.runners.torch import heap

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# the fewest faults taken by touching a 40 MiB buffer allocated anew, each freed before the next, once the first is
# past (torch's aligned allocation need not fit the chunk the one before it freed, but one of the next few does)
PROBE = """
import resource, sys, torch
from engine.runners.torch import heap
if sys.argv[1] == "keep":
    assert heap.keep(48 << 20)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touched = []
for _ in range(6):
    before = faults()
    torch.empty(10 << 20, dtype=torch.float32).fill_(1.0)
    touched.append(faults() - before)
print(min(touched[1:]))
"""


def fewest_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@glibc
def test_keep_serves_a_large_step_buffer_from_the_heap():
    assert fewest_faults("default") > 2000         # 40 MiB of 4 KiB pages, mapped afresh
    assert fewest_faults("keep") < 200


def test_keep_leaves_what_glibc_keeps_already():
    assert heap.keep(16 << 20) is False


def test_a_cpu_runner_keeps_a_decode_steps_logits(tiny_dir, monkeypatch):
    from engine.runners.torch.runner import TorchRunner
    kept = []
    monkeypatch.setattr(heap, "keep", kept.append)
    runner = TorchRunner(tiny_dir, device="cpu", max_batch_size=48)
    assert kept == [max(runner.step_rows, 48) * runner.vocab_size * 4]
