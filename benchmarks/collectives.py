"""Time and memory of the collectives ZeRO uses, on the backend this machine would use.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/collectives.py [--numel 5000000]

For each collective: the memory one call needs on top of its input and output
(CPU: RSS high-water growth, with the heap trimmed and VmHWM reset first; CUDA:
max_memory_allocated growth), then the median wall time over --iters calls. Evidence for how a bucket size or a choice of collective costs on Gloo,
where reduce_scatter_tensor and all_gather_into_tensor are not in place.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch
import torch.distributed as dist


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=5_000_000, help="fp32 elements of the whole buffer")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    n = args.numel // world * world
    full, shard = torch.randn(n, device=dev), torch.empty(n // world, device=dev)
    trim = None if cuda else ctypes.CDLL("libc.so.6").malloc_trim
    # torch 2.13 renamed the tensor collectives; older versions only have the old names.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    cases = {
        "all_reduce (in place)": lambda: dist.all_reduce(full),
        f"{reduce_scatter.__name__}": lambda: reduce_scatter(shard, full),
        "all_reduce + copy own shard": lambda: (dist.all_reduce(full), shard.copy_(full.view(world, -1)[rank])),
        f"{all_gather.__name__}": lambda: all_gather(full, shard),
        "all_gather into views": lambda: dist.all_gather(list(full.view(world, -1).unbind(0)), shard),
    }
    if rank == 0:
        print(f"{dist.get_backend()}, {world} ranks, buffer {n} fp32 = {n * 4 / 2**20:.1f} MiB")
    for name, fn in cases.items():
        fn()
        dist.barrier()
        # Memory: one call, from a trimmed heap and a reset high-water mark.
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            trim(0)
            base = _kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        fn()
        if cuda:
            torch.cuda.synchronize()
        grow = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else (_kib("VmHWM") - base) / 1024
        dist.barrier()
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        dist.barrier()
        if rank == 0:
            print(f"  {name:28s} {statistics.median(times) * 1e3:8.2f} ms   peak growth {grow:6.1f} MiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
