#!/usr/bin/env python
"""zerotrain's own host time per layer and pass: its hooks, views and bookkeeping, not the
collectives' nor the kernels' own time (CPU, Gloo, loopback).

    python benchmarks/host_time.py [--worlds 1,2] [--stages 3,0] [--layers 32] [--hidden 16] [--steps 20]

Trains a Llama whose compute is negligible (32 layers, hidden 16, seq 16) with every parameter
sharded at stage 3 (stage3_param_persistence_threshold 0) and no reuse (stage3_max_reuse_distance
0: backward gathers every layer again, the costly case). The method: every hook entry point
zerotrain installs (ParamGatherer's forward, root-part and backward hooks, GradReducer's gradient
hook and end-of-backward callback) is wrapped with a timer, and so is every collective of
zerotrain/comm/distributed.py and the wait() of the work it returns; a hook's time is its own
minus the collectives' and waits' inside it. Both are measured as this thread's CPU time
(time.thread_time, so other processes on a busy machine do not inflate it; autograd runs CPU
hooks in the calling thread) and as wall time. The figure is the median over the timed steps of
(hook time per step) / (layers x 2 passes), the root unit's share included. torch.compiler.disable's
own wrapper (~0.6 us a call) sits outside the timers.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

HOOKS = {
    "zerotrain.zero.param_gatherer:ParamGatherer": [
        "_before_forward", "_after_forward", "_before_root_part", "_after_root_part", "_before_backward"],
    "zerotrain.zero.grad_reducer:GradReducer": ["_on_grad", "_on_backward_end"],
}
COLLECTIVES = ["all_gather", "all_reduce", "reduce_scatter", "reduce_scatter_in_place", "broadcast"]


class _Clock:
    """CPU and wall time inside the outermost hook, less the collectives inside it."""

    def __init__(self) -> None:
        self.depth = 0
        self.cpu = self.wall = 0.0  # hook time so far, collectives excluded
        self.calls = 0
        self.by_hook: dict[str, float] = {}  # CPU time per entry point, collectives excluded
        self._comm_cpu = self._comm_wall = 0.0

    def hook(self, fn, name: str):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)  # nested (a hook calling another entry point): counted once
            self.depth, self.calls = 1, self.calls + 1
            comm_cpu, comm_wall = self._comm_cpu, self._comm_wall
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                c1, w1 = time.thread_time(), time.perf_counter()
                self.cpu += (c1 - c0) - (self._comm_cpu - comm_cpu)
                self.by_hook[name] = self.by_hook.get(name, 0.0) + (c1 - c0) - (self._comm_cpu - comm_cpu)
                self.wall += (w1 - w0) - (self._comm_wall - comm_wall)
                self.depth = 0

        return timed

    def collective(self, fn):
        def timed(*args, **kwargs):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                self._comm_cpu += time.thread_time() - c0
                self._comm_wall += time.perf_counter() - w0
            return _TimedWork(work, self) if work is not None else None

        return timed


class _TimedWork:
    """A collective's work handle whose wait() counts as the collective's time."""

    def __init__(self, work, clock: _Clock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args):
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return self._work.wait(*args)
        finally:
            self._clock._comm_cpu += time.thread_time() - c0
            self._clock._comm_wall += time.perf_counter() - w0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _instrument(clock: _Clock) -> None:
    import importlib

    from zerotrain.comm import distributed as zdist

    for where, names in HOOKS.items():
        module, cls = where.split(":")
        klass = getattr(importlib.import_module(module), cls)
        for name in names:
            if name in vars(klass):
                setattr(klass, name, clock.hook(getattr(klass, name), name))
    for name in COLLECTIVES:
        setattr(zdist, name, clock.collective(getattr(zdist, name)))


def _rank(rank: int, world: int, port: int, args, stage: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerotrain

    torch.set_num_threads(1)
    clock = _Clock()
    _instrument(clock)  # before initialize: the engine hooks the wrapped methods
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=args.seq, attn_implementation="eager"))
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=args.reuse_distance)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, 64, (1, args.seq), generator=torch.Generator().manual_seed(rank))
    per_step = []
    for step in range(args.warmup + args.steps):
        cpu, wall, calls = clock.cpu, clock.wall, clock.calls
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if step >= args.warmup:
            per_step.append((clock.cpu - cpu, clock.wall - wall, clock.calls - calls))
    queue.put((rank, per_step, {k: v / (args.warmup + args.steps) for k, v in clock.by_hook.items()}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, stage: int, args) -> dict:
    """Median over timed steps of the slowest rank's hook time per layer and pass (microseconds)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, stage, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, by_hook = {}, {}
    for _ in procs:
        rank, per_step, hooks = queue.get(timeout=args.timeout)
        results[rank] = per_step
        if rank == 0:
            by_hook = hooks
    for p in procs:
        p.join(timeout=30)
    per_pass = 2 * args.layers
    steps = list(zip(*(results[r] for r in range(world))))  # per step: each rank's (cpu, wall, calls)
    cpu = statistics.median(max(r[0] for r in s) for s in steps) / per_pass * 1e6
    wall = statistics.median(max(r[1] for r in s) for s in steps) / per_pass * 1e6
    calls = statistics.median(max(r[2] for r in s) for s in steps)
    return {"world": world, "stage": stage, "cpu_us": cpu, "wall_us": wall, "calls": calls, "by_hook": by_hook}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1,2", help="comma-separated world sizes (Gloo processes)")
    p.add_argument("--stages", default="3,0", help="comma-separated ZeRO stages")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--reuse-distance", type=int, default=0, help="stage3_max_reuse_distance (0: gather again in backward)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--by-hook", action="store_true", help="also each entry point's CPU time per step (rank 0, all steps)")
    args = p.parse_args()
    import importlib.util

    print(f"zerotrain from {importlib.util.find_spec('zerotrain').origin}")
    print(f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}; median of {args.steps} steps after "
          f"{args.warmup}; hook time less collectives, per layer and pass (slowest rank)")
    print("| world | stage | host CPU time (us/layer/pass) | wall (us/layer/pass) | hook calls/step |")
    print("| --- | --- | --- | --- | --- |")
    for world in [int(w) for w in args.worlds.split(",")]:
        for stage in [int(s) for s in args.stages.split(",")]:
            r = measure(world, stage, args)
            print(f"| {world} | {stage} | {r['cpu_us']:.1f} | {r['wall_us']:.1f} | {r['calls']:.0f} |", flush=True)
            if args.by_hook:
                print("    " + ", ".join(f"{k} {v * 1e3:.2f} ms/step" for k, v in sorted(r["by_hook"].items())))


if __name__ == "__main__":
    main()
