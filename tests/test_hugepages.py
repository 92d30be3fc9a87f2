"""A CPU model's weights packed into one huge-page mapping: same values, same outputs, each on its own cache line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import hugepages
from engine.models.loader import load_model

pytestmark = pytest.mark.skipif(not hugepages.supported(), reason="no madvise(MADV_HUGEPAGE) on this OS")


def smaps_entry(address: int) -> str:
    """The /proc/self/smaps block of the mapping that holds `address`."""
    blocks = Path("/proc/self/smaps").read_text().split("\n")
    for i, line in enumerate(blocks):
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                end = next((j for j in range(i + 1, len(blocks)) if "-" in blocks[j].split(" ")[0]), len(blocks))
                return "\n".join(blocks[i:end])
    raise LookupError(hex(address))


def test_empty_is_aligned_to_a_huge_page_and_advised_for_them():
    buf = hugepages.empty(3 * hugepages.HUGE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * hugepages.HUGE + 5
    assert buf.data_ptr() % hugepages.HUGE == 0
    flags = next(line for line in smaps_entry(buf.data_ptr()).splitlines() if line.startswith("VmFlags:"))
    assert "hg" in flags.split()            # the kernel's mark for madvise(MADV_HUGEPAGE)


def test_pack_moves_every_weight_into_one_mapping_and_keeps_the_model_output(tiny_dir):
    unpacked = load_model(tiny_dir, "float32")
    for p in unpacked.parameters():         # load_model packed them: give each its own torch storage again
        p.data = p.data.clone()
    packed = load_model(tiny_dir, "float32")
    params = list(packed.parameters())
    starts = sorted(p.data_ptr() for p in params)
    assert all(s % hugepages.ALIGN == 0 for s in starts)
    assert starts[-1] - starts[0] < sum(p.numel() * p.element_size() + hugepages.ALIGN for p in params)  # one arena
    assert len({smaps_entry(s).split()[0] for s in starts}) == 1
    for a, b in zip(unpacked.parameters(), params):
        assert torch.equal(a, b)
    ids, positions = torch.tensor([3, 17, 99]), torch.arange(3)
    with torch.inference_mode():
        def attn(layer, q, k, v):       # enough attention for a forward pass: each token attends to itself
            return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        assert torch.equal(packed(ids, positions, attn), unpacked(ids, positions, attn))


def test_pack_leaves_a_model_with_no_weights_alone():
    assert not hugepages.pack(torch.nn.Module())
