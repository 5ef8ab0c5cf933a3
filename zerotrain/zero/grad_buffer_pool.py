"""GradBufferPool: whole-gradient buffers and reduce-scatter temporaries lent bucket to bucket.

At stages 2-3 a bucket's whole gradient lives only from its first gradient to the end of
its reduction. Allocating one per bucket per backward costs an allocation (and, on the
CPU, fresh pages) per bucket; the pool instead hands a finished bucket's buffer to the
next bucket of the same size, so a backward allocates only as many buffers as are alive at
once (the buckets filling plus the reductions in flight), however many buckets there are.
The GradReducer empties the pool at the end of every reducing backward, so between
micro-steps a rank still holds only its gradient shard (the ZeRO accounting of
`ZeroOptimizer.resident_bytes` stays exact); on a GPU the caching allocator then reuses
the same blocks across steps.

A buffer is given back only after the work that reads it was waited on; every later
use is ordered after that wait on the same stream, so reuse never races a collective.
"""

from __future__ import annotations

import torch


class GradBufferPool:
    """Free 1-D buffers by (elements, dtype, device); `allocations` counts the ones it had to make."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.allocations = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized buffer of `numel` elements: a returned one when there is one."""
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `take`) is free: nothing reads or writes it any more."""
        self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)

    def clear(self) -> None:
        """Releases every free buffer's memory."""
        self._free.clear()

    @property
    def held_bytes(self) -> int:
        """Bytes of the free buffers the pool holds now."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
