"""Where a CPU step's large buffers come from. glibc serves an allocation of 32 MiB or more (its largest dynamic
mmap threshold) with a fresh mapping and unmaps it when it is freed, so a buffer that size, allocated each step,
faults its pages in again each step: a step of 32 rows of Gemma 3's 262,144 logits is 32 MiB, and its head took
about 1.4x as long as at 31 rows (docs/cpu-kernels.md). Raising the threshold past a step's logits keeps them in the
heap, where the next step's allocation reuses the same pages. The runner sizes it by its widest decode step: a step's
rows through the block kernels, or its batch (a float model's steps past 8 rows go through torch's GEMM)."""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # glibc's mallopt parameters
MIN_MMAP = 32 << 20                                # what glibc's own threshold grows to


def keep(largest: int) -> bool:
    """Serve allocations of up to `largest` bytes from the heap, and keep that much free at its top, rather than
    mapping and unmapping them each time. False where the C library is not glibc, or `largest` is within what
    glibc keeps already."""
    if largest < MIN_MMAP:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    size = largest + (1 << 20)                     # past the allocation's header and torch's alignment
    return bool(mallopt(M_MMAP_THRESHOLD, size)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * size))
