"""NvmeParamOffload: ZeRO-Infinity's stage-3 parameter shards, parked on NVMe between uses.

Each partitioned FlatParam's `local_shard` (the rank's slice of the parameters, in
the compute dtype, in host memory while it exists) has a file in a NvmeStore. A
gather reads it in first; once the unit is freed the shard goes to a cache of the
most recently used shards, at most `max_in_cpu` elements, and the least recently
used ones leave memory. Parameters change only when the optimizer step (or a
checkpoint load, or GatheredParameters' modifier) writes the shard: only then is it
dirty, and written when it leaves the cache; a clean shard's file already holds it,
so it is simply dropped.

Every rank makes the same calls with shards of the same sizes, so every decision
here (read now or later, keep or evict) is the same on every rank: the all-gathers
that follow are issued in the same order everywhere.
"""

from __future__ import annotations

import collections

import torch

from zerotrain.zero.flat_param import FlatParam
from zerotrain.zero.nvme_store import NvmeStore

# Where a shard is. IN_USE: in memory for a gather or a write, outside the cache.
_PARKED, _READING, _IN_USE, _CACHED = "parked", "reading", "in use", "cached"


class NvmeParamOffload:
    """Swaps the parameter shards of stage-3 FlatParams in and out of a NvmeStore."""

    def __init__(self, store: NvmeStore, max_in_cpu: int) -> None:
        self.store = store
        self.max_in_cpu = max_in_cpu
        self._key: dict[int, str] = {}
        self._where: dict[int, str] = {}
        self._dirty: set[int] = set()  # in memory and newer than the file
        self._cache: collections.OrderedDict[int, FlatParam] = collections.OrderedDict()  # least recent first
        self._cached_numel = 0

    def adopt(self, fp: FlatParam) -> None:
        """Takes over `fp`'s kept shard (after `keep_only_shard`); it goes to the cache, dirty."""
        if fp.master_is_param:
            # The shard leaves memory; the master the optimizer updates must stay: its own tensor.
            fp.master = fp.local_shard.detach().clone()
            fp.master_is_param = False
        i = id(fp)
        self._key[i] = f"param{len(self._key)}"
        self._where[i] = _IN_USE
        self._dirty.add(i)
        fp.swap = self
        self.release(fp)

    def fetch(self, fp: FlatParam, async_op: bool = False) -> bool:
        """Brings `fp`'s shard into memory for a gather.

        With `async_op`, a parked shard only has its read launched: returns True, and the
        next fetch waits for it. Otherwise returns False with the shard in memory.
        """
        i = id(fp)
        where = self._where[i]
        if where == _CACHED:
            self._uncache(fp)
        elif where == _READING:
            self.store.wait(self._key[i])
        elif where == _PARKED:
            self.store.swap_in(self._key[i], fp.local_shard, async_op=async_op)
            if async_op:
                self._where[i] = _READING
                return True
        self._where[i] = _IN_USE
        return False

    def release(self, fp: FlatParam) -> None:
        """`fp` no longer needs its shard (its unit was freed): cache it, evicting the least recent."""
        i = id(fp)
        if self._where[i] == _READING:
            self.fetch(fp)  # a prefetch nobody used: let the read land
        if self._where[i] != _IN_USE:
            return
        self._where[i] = _CACHED
        self._cache[i] = fp
        self._cached_numel += fp.shard_size
        while self._cached_numel > self.max_in_cpu:
            self._evict(next(iter(self._cache.values())))

    def overwrite(self, fp: FlatParam, values: torch.Tensor) -> None:
        """Sets `fp`'s shard to `values` (no read of the old ones); it is written when evicted."""
        i = id(fp)
        was_in_use = self._where[i] == _IN_USE
        if self._where[i] == _PARKED:
            self.store.allocate(self._key[i], fp.local_shard)
            self._where[i] = _IN_USE
        else:
            self.fetch(fp)
        with torch.no_grad():
            fp.local_shard.copy_(values)
        self._dirty.add(i)
        if not was_in_use:
            self.release(fp)

    def wait_all(self) -> None:
        """Completes every pending read and write (tests, before looking at the files)."""
        self.store.wait_all()

    def _uncache(self, fp: FlatParam) -> None:
        del self._cache[id(fp)]
        self._cached_numel -= fp.shard_size

    def _evict(self, fp: FlatParam) -> None:
        i = id(fp)
        self._uncache(fp)
        if i in self._dirty:
            self.store.swap_out(self._key[i], fp.local_shard)  # storage released when the write ends
            self._dirty.discard(i)
        else:
            self.store.discard(self._key[i], fp.local_shard)
        self._where[i] = _PARKED
