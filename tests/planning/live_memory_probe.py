"""The peak of live tensor memory on the CPU, op by op: what torch.cuda.max_memory_allocated says on a GPU.

A `TorchDispatchMode` sees every tensor each aten op returns; each new storage is followed with a
weak reference until it is freed, giving [allocated, freed) intervals in op order. The peak is taken
afterwards, so storages found only later to be something else (the gradients autograd accumulates,
which the memory model counts apart from activations) can be left out of it.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveMemory(TorchDispatchMode):
    """Records when each storage made inside the `with` block lives; `peak(excluding)` is the most bytes
    alive at once. Storages alive on entry (parameters) are never counted."""

    def __init__(self, existing: set[int] = frozenset()) -> None:
        super().__init__()
        self.existing = set(existing)
        self.live: dict[int, list] = {}  # key -> [ref, bytes, op index made, tag]
        self.intervals: list[tuple[int, int, int, str | None]] = []  # (made, freed, bytes, tag)
        self.step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.step += 1
        self._sweep()  # before registering: a freed storage's address may be reused by an output
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in self.existing:
                    self.live[key] = [StorageWeakRef(storage), storage.nbytes(), self.step, None]
        return out

    def tag(self, t: torch.Tensor, label: str) -> None:
        """Files the storage of `t` (alive now, made in the block) under `label`."""
        entry = self.live.get(t.untyped_storage()._cdata)
        if entry is not None:
            entry[3] = label

    def _sweep(self) -> None:
        for key, (ref, nbytes, made, tag) in list(self.live.items()):
            if ref.expired():
                self.intervals.append((made, self.step, nbytes, tag))
                del self.live[key]

    def __exit__(self, *exc):
        self._sweep()
        for _, nbytes, made, tag in self.live.values():  # still alive: to the end
            self.intervals.append((made, self.step + 1, nbytes, tag))
        return super().__exit__(*exc)

    def alive(self, at: int, tags: set[str | None] = frozenset({None})) -> int:
        """Bytes alive after op `at` whose tag is in `tags` (default: untagged)."""
        return sum(n for made, freed, n, tag in self.intervals if tag in tags and made <= at < freed)

    def peak(self, tags: set[str | None] = frozenset({None})) -> int:
        """Most bytes alive at once over the block, of the storages whose tag is in `tags`."""
        delta = [0] * (self.step + 3)
        for made, freed, nbytes, tag in self.intervals:
            if tag in tags:
                delta[made] += nbytes
                delta[freed] -= nbytes
        best = alive = 0
        for d in delta:
            alive += d
            best = max(best, alive)
        return best


def storage_key(t: torch.Tensor) -> int:
    """The key `LiveMemory` files a tensor's storage under."""
    return t.untyped_storage()._cdata
