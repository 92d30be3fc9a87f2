"""Host ints to the device without waiting for it.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream, so a
step launched while the previous one runs (lookahead) would wait for it. From pinned memory the copy is queued on
the stream like a kernel; torch's pinned allocator keeps the buffer until the copy has run."""
from __future__ import annotations

import torch


def upload(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
