"""Exposed communication: how long a step's collectives run on the GPU while nothing else does.

From one step profiled with torch.profiler (device activity only), exported as a Chrome trace:
every GPU activity is an interval [ts, ts + dur) in microseconds. NCCL's kernels (names start
with "nccl") are communication; every other kernel, memcpy and memset is work that can hide it.
Exposed communication is the length of (union of NCCL intervals) minus (union of the others):
the time the step waits for communication alone. Overlapped communication costs nothing here,
which is what ZeRO's bucketing and prefetching aim at.

Also from the same intervals: the span of the step's GPU activity and the time the GPU had no
work at all in it (host-side overhead such as launch latency and Python, which MFU pays for).

A CPU run has no device timeline (Gloo runs the collectives on host threads): `summarize` then
returns None for the GPU figures with the reason, from the same code.
"""

from __future__ import annotations

import json
from pathlib import Path

Interval = tuple[float, float]

# Chrome-trace categories of GPU activity in torch.profiler (Kineto) traces.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint, covering exactly what the input covers."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: list[Interval]) -> float:
    """Total length covered (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def uncovered(a: list[Interval], b: list[Interval]) -> float:
    """Length of the part of union(a) that union(b) does not cover."""
    a, b = union(a), union(b)
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            if cursor >= end:
                break
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def is_communication(name: str) -> bool:
    """NCCL's kernels: ncclKernel_*, ncclDevKernel_* (every NCCL version names them so)."""
    return name.lower().startswith("nccl")


def gpu_intervals(trace: dict) -> tuple[list[Interval], list[Interval]]:
    """(communication, other GPU work) intervals in microseconds from a Chrome trace dict."""
    comm: list[Interval] = []
    other: list[Interval] = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in GPU_CATEGORIES:
            continue
        start = float(event["ts"])
        interval = (start, start + float(event.get("dur", 0.0)))
        (comm if is_communication(str(event.get("name", ""))) else other).append(interval)
    return comm, other


def summarize(trace: dict, device_type: str) -> dict:
    """The step's GPU timeline in milliseconds: communication (all, and exposed), busy, span, idle.

    Without GPU activity in the trace every figure is None and `note` says why.
    """
    comm, other = gpu_intervals(trace)
    if not comm and not other:
        why = ("CPU run: no device timeline (Gloo runs collectives on host threads; their time is inside the "
               "phase times)" if device_type != "cuda" else "the profiled step recorded no GPU activity")
        return {"exposed_comm_ms": None, "comm_ms": None, "gpu_busy_ms": None, "gpu_span_ms": None,
                "gpu_idle_ms": None, "kernels": 0, "comm_kernels": 0, "note": why}
    everything = comm + other
    span = max(e for _, e in everything) - min(s for s, _ in everything)
    busy = length(everything)
    note = None if comm else "no NCCL kernel ran in the profiled step (nothing to expose)"
    return {
        "exposed_comm_ms": uncovered(comm, other) / 1e3,
        "comm_ms": length(comm) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_span_ms": span / 1e3,
        "gpu_idle_ms": (span - busy) / 1e3,
        "kernels": len(everything),
        "comm_kernels": len(comm),
        "note": note,
    }


def summarize_file(path: Path, device_type: str) -> dict:
    """`summarize` of a Chrome trace file written by torch.profiler's export_chrome_trace."""
    with open(path) as f:
        return summarize(json.load(f), device_type)
