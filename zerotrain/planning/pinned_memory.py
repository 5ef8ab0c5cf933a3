"""What a page-locked host buffer takes: torch's pinned allocator rounds each request up to a power of two.

The caching host allocator behind `tensor.pin_memory()` and `torch.empty(..., pin_memory=True)`
serves each request from a block of the next power of two, so a 1.8 GiB buffer holds 2 GiB.
"""

from __future__ import annotations


def pinned_bytes(nbytes: int) -> int:
    """The host bytes a pinned buffer of `nbytes` holds (0 for none)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
