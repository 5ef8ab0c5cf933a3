"""Collective bandwidth arithmetic for `zerotrain bench comm`: sizes, nccl-tests' bandwidths, result rows.

Pure functions: no torch.distributed here, so every formula is unit-tested on its own.

Conventions are those of nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md, and
src/all_gather.cu / reduce_scatter.cu for which bytes S counts):

* ``algbw = S / t``, in GB/s with GB = 1e9 bytes; ``t`` is the mean time of one call.
* ``busbw = algbw * factor``: all-reduce 2(n-1)/n; all-gather and reduce-scatter (n-1)/n.
  The factor makes busbw comparable with one rank's link speed whatever the rank count.
* S, "size": all-reduce, the buffer each rank holds (input = output); all-gather, the total
  output (every rank's chunk, ``sendcount * n``); reduce-scatter, the total input
  (``recvcount * n``). A requested size is rounded down so that it splits into n equal chunks.
* Time: each rank's mean over the timed calls, then averaged over ranks (nccl-tests' default ``-a 1``).

The bytes check: busbw * t is, by construction, what each rank must send in an optimal
(ring) algorithm: (n-1) chunks of S/n for all-gather and reduce-scatter, twice that for
all-reduce (a reduce-scatter then an all-gather). `bytes_sent_per_rank` counts it from the
chunk sizes; zerotrain's COMM_COUNTER counts the same calls its own way (all-reduce 2S,
all-gather its output S, reduce-scatter its input S: the ZeRO paper's accounting); the two
must agree up to the (n-1)/n factor, and with busbw * t.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
MARKER = "ZEROTRAIN_BENCH_COMM"
"""Starts the worker's result lines (`MARKER KIND JSON`), which reach `bench comm` in the launcher's output."""
ELEMENT_SIZE = 4
"""Bytes per element: float32, nccl-tests' default type."""
GB = 1e9
"""nccl-tests report GB/s with GB = 10^9 bytes (sizes use binary K/M/G)."""
DEFAULT_MIN_SIZE = 1 << 10
DEFAULT_MAX_SIZE_GPU = 1 << 30
DEFAULT_MAX_SIZE_CPU = 64 << 20
"""Gloo over TCP moves ~1 GB/s at best: 1 GB sizes would take minutes, for nothing learnt."""
SLOW_FRACTION = 0.8
"""A pair below this fraction of the median pair bandwidth is called slow."""

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "1K", "64M", "1G", "4096" (binary units, as nccl-tests' -b/-e); ValueError if unreadable."""
    found = _SIZE.match(str(text))
    if not found or int(found.group(1)) <= 0:
        raise ValueError(f"cannot read the size {text!r}: write a positive number of bytes, "
                         "or with K, M or G (1K = 1024)")
    return int(found.group(1)) * _UNITS[found.group(2).upper()]


def format_size(size: int) -> str:
    """"1K", "64M", "1G"; plain bytes when no unit divides the size."""
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return f"{size}B"


def format_bytes(count: float) -> str:
    """A byte count for a table: "96M", "1.5K", "768B" (binary units)."""
    for unit in ("G", "M", "K"):
        if count >= _UNITS[unit]:
            value = count / _UNITS[unit]
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{count:.0f}B"


def format_time_us(seconds: float) -> str:
    """Microseconds with nccl-tests' precision: 2 decimals under 100 us, 1 under 10 ms, none above."""
    us = seconds * 1e6
    return f"{us:,.0f}" if us >= 10000 else f"{us:,.1f}" if us >= 100 else f"{us:.2f}"


def size_list(min_size: int, max_size: int, factor: int = 4) -> list[int]:
    """min_size, min_size*factor, ... up to max_size (max_size included even off the progression)."""
    if factor < 2:
        raise ValueError(f"the size factor must be 2 or more, got {factor}")
    if min_size > max_size:
        raise ValueError(f"the smallest size {format_size(min_size)} is above the largest {format_size(max_size)}")
    sizes = [min_size]
    while sizes[-1] * factor <= max_size:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for `collective` over `ranks` ranks."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if collective in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def element_counts(collective: str, size: int, ranks: int, element_size: int = ELEMENT_SIZE) -> tuple[int, int]:
    """(input, output) elements per rank for a call of `size` bytes S, rounded down as nccl-tests do."""
    count = size // element_size
    if collective == "all_reduce":
        return count, count
    chunk = count // ranks
    if collective == "all_gather":
        return chunk, chunk * ranks
    if collective == "reduce_scatter":
        return chunk * ranks, chunk
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def collective_bytes(collective: str, input_elements: int, output_elements: int,
                     element_size: int = ELEMENT_SIZE) -> int:
    """S of one call: the all-reduce buffer, the all-gather output, the reduce-scatter input."""
    return (output_elements if collective == "all_gather" else input_elements) * element_size


def counter_bytes(collective: str, size: int) -> int:
    """What zerotrain's COMM_COUNTER records for one call of S bytes (distributed.CommCounter)."""
    return 2 * size if collective == "all_reduce" else size


def bytes_sent_per_rank(collective: str, size: int, ranks: int) -> float:
    """Bytes one rank sends in an optimal (ring) algorithm: chunks of S/n, n-1 per pass, 2 passes for all-reduce."""
    passes = 2 if collective == "all_reduce" else 1
    return passes * (ranks - 1) * (size / ranks)


@dataclass
class BandwidthRow:
    """One collective at one size: nccl-tests' columns plus the bytes accounting."""

    collective: str
    size: int
    """S in bytes (see the module docstring)."""
    elements: int
    """Elements of S (float32)."""
    ranks: int
    time_s: float
    """Mean time of one call, averaged over ranks."""
    algbw_gbps: float
    busbw_gbps: float
    bytes_per_rank: float
    """What each rank sends in an optimal algorithm: equals busbw * time."""
    counted_bytes: int
    """What COMM_COUNTER recorded per call."""
    wrong: int = 0
    """Elements of the checked result that were wrong (0 = the collective computed the right thing)."""

    def as_dict(self) -> dict:
        return asdict(self)

    def bytes_problem(self) -> str | None:
        """Why the bytes do not add up, or None: counter vs convention, counter vs ring count, busbw * t."""
        expected = counter_bytes(self.collective, self.size)
        if self.counted_bytes != expected:
            return f"COMM_COUNTER recorded {self.counted_bytes} bytes per call, expected {expected}"
        # The counter's S (2S for all-reduce) is what one rank would send to a single peer; over a
        # ring each rank sends all but its own 1/n of it.
        from_counter = self.counted_bytes * (self.ranks - 1) / self.ranks
        if not math.isclose(from_counter, self.bytes_per_rank, rel_tol=1e-12):
            return f"counted {from_counter:.0f} bytes sent per rank, the chunk count gives {self.bytes_per_rank:.0f}"
        moved = self.busbw_gbps * GB * self.time_s
        if not math.isclose(moved, self.bytes_per_rank, rel_tol=1e-9, abs_tol=1e-6):
            return f"busbw x time = {moved:.0f} bytes, but each rank sends {self.bytes_per_rank:.0f}"
        return None


def bandwidth_row(collective: str, size: int, ranks: int, time_s: float, counted_bytes: int,
                  wrong: int = 0, element_size: int = ELEMENT_SIZE) -> BandwidthRow:
    """The row for one timed collective: algbw and busbw from S and t as nccl-tests compute them."""
    algbw = size / time_s / GB
    return BandwidthRow(
        collective=collective, size=size, elements=size // element_size, ranks=ranks, time_s=time_s,
        algbw_gbps=algbw, busbw_gbps=algbw * bus_factor(collective, ranks),
        bytes_per_rank=bytes_sent_per_rank(collective, size, ranks), counted_bytes=counted_bytes, wrong=wrong,
    )


@dataclass
class PairResult:
    """One node pair's all-reduce at the largest size (one rank per node); busbw None when it failed."""

    nodes: tuple[str, str]
    busbw_gbps: float | None
    time_s: float | None = None
    size: int | None = None
    error: str | None = None

    def as_dict(self) -> dict:
        return {**asdict(self), "nodes": list(self.nodes)}


def slowest_pair(pairs: list[PairResult]) -> PairResult | None:
    """The failed pair if any (first), else the one of lowest bus bandwidth; None without pairs."""
    if not pairs:
        return None
    failed = [p for p in pairs if p.busbw_gbps is None]
    return failed[0] if failed else min(pairs, key=lambda p: p.busbw_gbps)


def diagnose_pairs(pairs: list[PairResult], slow_fraction: float = SLOW_FRACTION) -> dict:
    """Slow links and slow nodes from the pair results.

    A pair is slow when it failed or its busbw is below `slow_fraction` of the median. A node
    all of whose pairs (two or more) are slow is a slow node: its pairs are explained by it.
    Slow pairs left over are slow links. Returns {"median_gbps", "slow_nodes", "slow_links"}.
    """
    measured = [p.busbw_gbps for p in pairs if p.busbw_gbps is not None]
    median = statistics.median(measured) if measured else None
    slow = [p for p in pairs if p.busbw_gbps is None or (median is not None and p.busbw_gbps < slow_fraction * median)]
    nodes = list(dict.fromkeys(node for p in pairs for node in p.nodes))
    slow_nodes = []
    for node in nodes:
        own = [p for p in pairs if node in p.nodes]
        if len(own) >= 2 and all(p in slow for p in own):
            slow_nodes.append(node)
    links = [list(p.nodes) for p in slow if not set(p.nodes) & set(slow_nodes)]
    return {"median_gbps": median, "slow_nodes": slow_nodes, "slow_links": links}
