"""One rank of `zerotrain bench comm`: times collectives and prints the results for the command to collect.

    zerotrain launch --hostfile H --no_local_rank --module zerotrain.bench.comm_worker \\
        [--collectives all_reduce,all_gather,reduce_scatter] [--min-size 1K] [--max-size 64M] [--factor 4]
        [--warmup 5] [--iters 20]

Every rank runs every call; rank 0 prints one marked line per result, `MARKER KIND JSON`
(KIND: start, row, done), which reaches `zerotrain bench comm` through the launcher's merged
output (prefixed `[host rank]: `), so no file needs to be shared between the nodes.

Each collective at each size: one checked call (its result compared with the known answer),
`--warmup` untimed calls, then `--iters` calls timed together between a barrier and a device
synchronize, as nccl-tests do; the mean time per call is averaged over ranks. The calls go
through zerotrain.comm.distributed's counted collectives, so COMM_COUNTER's bytes come back with the times.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerotrain.system.process_exit import end_rank
from zerotrain.bench.bandwidth import (
    COLLECTIVES, DEFAULT_MAX_SIZE_CPU, DEFAULT_MAX_SIZE_GPU, DEFAULT_MIN_SIZE, ELEMENT_SIZE, MARKER, bandwidth_row,
    collective_bytes, element_counts, parse_size, size_list,
)
PURPOSE = "bench"
"""The COMM_COUNTER purpose the timed calls are counted under."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zerotrain.bench.comm_worker")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help="comma-separated, of " + ", ".join(COLLECTIVES))
    parser.add_argument("--min-size", type=parse_size, default=DEFAULT_MIN_SIZE)
    parser.add_argument("--max-size", type=parse_size, default=None,
                        help=f"default: 1G with NCCL, {DEFAULT_MAX_SIZE_CPU >> 20}M with Gloo")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    args.collectives = [name.strip() for name in args.collectives.split(",") if name.strip()]
    unknown = [name for name in args.collectives if name not in COLLECTIVES]
    if unknown or not args.collectives:
        parser.error(f"--collectives: unknown {unknown}; choose from {', '.join(COLLECTIVES)}")
    return args


def emit(kind: str, payload: dict) -> None:
    """One marked line on stdout (rank 0 only calls this)."""
    print(f"{MARKER} {kind} {json.dumps(payload, separators=(',', ':'))}", flush=True)


class Collective:
    """One collective's buffers at one size, its call, and a check of its result."""

    def __init__(self, name: str, size: int, rank: int, ranks: int, device: torch.device) -> None:
        self.name, self.rank, self.ranks = name, rank, ranks
        inputs, outputs = element_counts(name, size, ranks)
        self.size = collective_bytes(name, inputs, outputs)
        self.input = torch.zeros(inputs, dtype=torch.float32, device=device)
        # all-reduce works in place (as DeepSpeed's gradient all-reduce does): one buffer.
        self.output = self.input if name == "all_reduce" else torch.zeros(outputs, dtype=torch.float32, device=device)

    def call(self) -> None:
        from zerotrain.comm import distributed as zd

        if self.name == "all_reduce":
            zd.all_reduce(self.input, PURPOSE)
        elif self.name == "all_gather":
            zd.all_gather(self.output, self.input, PURPOSE)
        else:
            zd.reduce_scatter(self.output, self.input, PURPOSE)

    def wrong_elements(self) -> int:
        """Runs one call on known data; the elements (this rank's) whose result is wrong."""
        n, r = self.ranks, self.rank
        total = n * (n + 1) / 2  # the sum over ranks of (rank + 1)
        if self.name == "all_reduce":
            self.input.fill_(r + 1)
            expected: torch.Tensor | float = total
        elif self.name == "all_gather":
            self.input.fill_(r + 1)
            chunk = self.input.numel()
            expected = torch.arange(1, n + 1, dtype=torch.float32, device=self.input.device).repeat_interleave(chunk)
        else:
            # Chunk j of every rank's input holds (rank + 1) * (j + 1): rank r must receive chunk r's sum.
            chunk = self.output.numel()
            scale = torch.arange(1, n + 1, dtype=torch.float32, device=self.input.device).repeat_interleave(chunk)
            self.input.copy_(scale * (r + 1))
            expected = total * (r + 1)
        self.call()
        wrong = int((self.output != expected).sum().item())
        self.input.zero_()
        return wrong


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(coll: Collective, warmup: int, iters: int, device: torch.device) -> tuple[float, int, int]:
    """(mean seconds per call on this rank, COMM_COUNTER bytes per call, wrong elements on this rank)."""
    from zerotrain.comm.distributed import COMM_COUNTER

    wrong = coll.wrong_elements()
    for _ in range(warmup):
        coll.call()
    _synchronize(device)
    dist.barrier()
    counted_before = COMM_COUNTER.elements[PURPOSE]
    start = time.perf_counter()
    for _ in range(iters):
        coll.call()
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    counted = (COMM_COUNTER.elements[PURPOSE] - counted_before) * ELEMENT_SIZE // iters
    return seconds, counted, wrong


def _sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    # Bookkeeping, not a measured collective: straight to torch.distributed, uncounted.
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def run(args: argparse.Namespace, emit_line: Callable[[str, dict], None] = emit) -> int:
    from zerotrain.comm.distributed import device_for, init_distributed

    launch = init_distributed(timeout_s=600.0)
    rank, ranks = launch.rank, launch.world_size
    device = device_for(launch.local_rank)
    backend = dist.get_backend()
    capped = args.max_size is None and device.type != "cuda"
    max_size = args.max_size or (DEFAULT_MAX_SIZE_GPU if device.type == "cuda" else DEFAULT_MAX_SIZE_CPU)
    sizes = size_list(min(args.min_size, max_size), max_size, args.factor)
    if rank == 0:
        emit_line("start", {"ranks": ranks, "backend": backend, "device": device.type, "sizes": sizes,
                            "collectives": args.collectives, "capped": capped, "warmup": args.warmup,
                            "iters": args.iters})
    for name in args.collectives:
        for size in sizes:
            coll = Collective(name, size, rank, ranks, device)
            seconds, counted, wrong = time_collective(coll, args.warmup, args.iters, device)
            total_seconds, total_wrong = _sum_over_ranks([seconds, float(wrong)], device)
            row = bandwidth_row(name, coll.size, ranks, total_seconds / ranks, counted, int(total_wrong))
            del coll
            if rank == 0:
                emit_line("row", row.as_dict())
    if rank == 0:
        emit_line("done", {})
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    end_rank(main())  # a finished rank skips the interpreter's teardown
