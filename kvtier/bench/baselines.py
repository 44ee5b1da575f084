"""What every benchmark's hardware limit shares: the memory it copies into, and the check on its ratios.

A ratio of kvtier's throughput to a limit measured in the same run can only
exceed 1.0 by noise; well above it, the limit was measured on something slower
than what kvtier used (4 KiB pages where the tier's pool has huge pages, one read
in flight where kvtier keeps two, ...). Such a ratio is printed with a warning,
never posted as a result.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

#: a ratio against a hardware limit above this is noise no longer: the baseline is wrong
RATIO_WARN_ABOVE = 1.05


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer of the kind the host tier's pool is: an anonymous mmap advised
    to use transparent huge pages before its first touch, then faulted in page by page."""
    size = max(nbytes, mmap.PAGESIZE)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off or unsupported: the pool falls back alike
            pass
    buf = np.frombuffer(m, dtype=np.uint8)
    buf[:: mmap.PAGESIZE] = 0  # prefault, like HostTier(prefault=True)
    return buf[:nbytes]


def ratio_warnings(ratios: dict[str, float | None], *, what: str = "limit",
                   above: float = RATIO_WARN_ABOVE) -> list[str]:
    """One line per ratio above ``above``: each means the baseline it was taken against is wrong."""
    return [
        f"{name} = {value:.3f} > {above}: kvtier measured faster than its {what}; "
        f"the baseline is wrong (not the same memory, I/O size or reads in flight), not kvtier fast"
        for name, value in ratios.items() if value is not None and value > above
    ]


def report_warnings(warnings: list[str]) -> None:
    for line in warnings:
        print(f"WARNING: {line}", file=sys.stderr)
