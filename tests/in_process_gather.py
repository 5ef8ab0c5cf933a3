"""Stage-3 buckets of every rank held in one process: zerotrain's all-gather replaced by one over them.

Used by tests that check partitioning and offload without starting ranks.
"""

from __future__ import annotations

import torch


class FinishedWork:
    """The work handle of a collective that already finished."""

    def wait(self) -> None:
        pass


def gather_over(monkeypatch, buckets: list) -> None:
    """Makes `all_gather` concatenate the kept shards of `buckets` (one FlatParam per rank, in rank
    order), as the collective concatenates the ranks' shards; the caller's shard must be one of them."""

    def all_gather(out, inp, purpose, group=None, async_op=False):
        assert sum(fp.local_shard is inp for fp in buckets) == 1, "a rank gathers from its own kept shard"
        out.copy_(torch.cat([fp.local_shard for fp in buckets]))
        return FinishedWork()

    monkeypatch.setattr("zerotrain.comm.distributed.all_gather", all_gather)
