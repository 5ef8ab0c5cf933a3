"""A stop request one rank sees stops every rank after the same step, with no device collective per step."""

from __future__ import annotations

import pytest

from tests.conftest import run_on_ranks


class _RequestFrom:
    """A StopSignal stand-in: this rank sees a request from poll number `at` on (never with None)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.polls = at, 0

    def requested_here(self) -> bool:
        seen = self.at is not None and self.polls >= self.at
        self.polls += 1
        return seen


def _stop_poll_numbers(cases: list[tuple[int | None, int]]) -> list[tuple[int | None, int]]:
    """For each (poll at which rank 1 sees a request, or None; polls), a fresh agreement polled that
    many times: (the poll that stopped, or None; .item() reads meanwhile), on one process group."""
    import torch
    import torch.distributed as dist

    from zerotrain.train.stop_agreement import StopAgreement

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for request_at_rank_1, polls in cases:
        agreement = StopAgreement(_RequestFrom(request_at_rank_1 if rank == 1 else None), dist.get_world_size())
        reads = 0
        original_item = torch.Tensor.item

        def counted_item(self):
            nonlocal reads
            reads += 1
            return original_item(self)

        torch.Tensor.item = counted_item  # the agreement must not read a tensor by .item() (a device sync on a GPU)
        try:
            stopped_at = next((n for n in range(polls) if agreement.poll()), None)
        finally:
            torch.Tensor.item = original_item
        agreement.close()
        results.append((stopped_at, reads))
    return results


@pytest.fixture(scope="module")
def two_rank_polls() -> list[list[tuple[int | None, int]]]:
    """Per rank: a request seen by rank 1 at its poll 3 (8 polls), then no request (6 polls); one launch."""
    return run_on_ranks(2, _stop_poll_numbers, [(3, 8), (None, 6)])


@pytest.mark.slow
def test_a_request_on_one_rank_stops_every_rank_one_poll_later_without_item_reads(two_rank_polls):
    # Rank 1 sees the request at its poll 3; the all-reduce started then is read at poll 4, on both ranks.
    assert [rank[0] for rank in two_rank_polls] == [(4, 0), (4, 0)]


@pytest.mark.slow
def test_without_a_request_no_rank_stops(two_rank_polls):
    assert [rank[1] for rank in two_rank_polls] == [(None, 0), (None, 0)]


def test_one_rank_stops_at_the_poll_that_sees_the_request():
    from zerotrain.train.stop_agreement import StopAgreement

    agreement = StopAgreement(_RequestFrom(2), world_size=1)
    assert [agreement.poll() for _ in range(4)] == [False, False, True, True]
