"""One engine of the speed check, in one fresh process: each checkpointing mode in turn (in the
dry run, several engines in turn: speed.py --engines-per-process).

Per mode: build the model directly on the device (seeded: every engine starts from the same
weights), switch checkpointing on or off, wrap it in the engine, run the harness's own loop
(`worker.train_loop`: warm-up, timed steps, one memory-measuring step), then one more step
under torch.profiler for the GPU timeline (`speed_timeline`). Each mode's result is written to
`<result_dir>/<engine>.<mode>.json` as soon as it exists, so a later hang or crash keeps it.

Started by speed.py as a world of one, or of `--world` ranks (RANK/WORLD_SIZE/MASTER_* set by the
parent, rank r on GPU r % GPUs): the engines that use a process group get one over NCCL (Gloo on a CPU,
or with `--backend gloo`: two ranks sharing one GPU, which NCCL refuses); `plain` makes none. Rank 0
writes the results; each step's loss is the mean over ranks (the global batch's, as a world of one
computes it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

from speed_launch import wait_for_go, write_result


def run(engines: list[str], settings_file: str, modes: list[str], result_dir: str,
        go_file: str | None = None) -> None:
    """Runs each of `engines` in each of `modes` ("off"/"on"), one JSON per engine and mode; exits the process.

    Everything is imported first; then, with `go_file`, it waits for the parent's go (speed_launch).
    """
    _die_with_parent()
    import torch

    importable = []
    for engine in engines:
        try:
            _preload(engine)
            importable.append(engine)
        except Exception as exc:  # noqa: BLE001 - e.g. an engine that does not import here: every mode reports why
            reason = " ".join(f"import failed: {type(exc).__name__}: {exc}".split())[:400]
            for mode in modes:
                write_result(Path(result_dir) / f"{engine}.{mode}.json",
                             {"ok": False, "reason": reason, "traceback": traceback.format_exc()[-4000:]})
    if not importable:
        os._exit(3)
    # What the imports made lives as long as the process: frozen, it is left out of the gc.collect()
    # calls around each mode (three per mode, ~0.4 s of CPU each over torch's and transformers' objects).
    gc.freeze()
    wait_for_go(go_file)
    args = argparse.Namespace(**json.loads(Path(settings_file).read_text()))  # written before the go
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = args.device == "cuda"
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world > 1 and getattr(args, "backend", None):
        _init_group(args.backend, cuda)  # the engines reuse a group that exists
    failed = len(importable) < len(engines)
    for engine, mode in [(e, m) for e in importable for m in modes]:
        out = Path(result_dir) / f"{engine}.{mode}.json"
        t0 = time.perf_counter()
        try:
            result = _one_mode(engine, mode == "on", args, cuda, Path(result_dir), rank, world)
        except Exception as exc:  # noqa: BLE001 - reported in the engine's row; the next mode still runs
            result = {"ok": False, "reason": " ".join(f"{type(exc).__name__}: {exc}".split())[:400],
                      "traceback": traceback.format_exc()[-4000:]}
            failed = True
        result["wall_s"] = time.perf_counter() - t0
        if rank == 0:
            write_result(out, result)
        print(f"[speed-worker] {engine} checkpointing {mode}: {'ok' if result['ok'] else result['reason']} "
              f"({result['wall_s']:.1f}s)", flush=True)
        _release(cuda)
    sys.stdout.flush()
    # No teardown of process groups or engines: a hang there would only cost the budget.
    os._exit(3 if failed else 0)


def _one_mode(engine: str, checkpointing: bool, args, cuda: bool, result_dir: Path, rank: int = 0,
              world: int = 1) -> dict:
    import torch
    from speed_variants import FirstStepClock, build_column, column_micro_batch, counts_since, dynamo_counts
    from worker import MemoryProbe, device_sync, train_loop
    from workload import build_model, rank_batch

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mode_args = argparse.Namespace(**{**vars(args), "checkpointing": checkpointing,
                                      "micro_batch": column_micro_batch(engine, args.micro_batch)})
    # The probe starts before the model exists: the peak is everything this mode allocated
    # (model, engine state, activations), what the planner predicts; leftovers of an earlier
    # mode in this process are in its baseline and so left out.
    probe = MemoryProbe(device)
    baseline = probe.base
    t0 = time.perf_counter()
    model = build_model(mode_args, device=device if cuda else None)
    counts = dynamo_counts()
    trainer = build_column(engine, model, mode_args)
    del model
    gc.collect()
    probe.engine_built()
    build_s = time.perf_counter() - t0
    clock = FirstStepClock(device_sync(trainer.device))
    clock.wrap(trainer)
    t0 = time.perf_counter()
    loop = train_loop(trainer, mode_args, rank, world, probe)
    loop_s = time.perf_counter() - t0
    losses = _mean_over_ranks(loop["losses"], trainer.device, world)
    reserved = torch.cuda.memory_reserved(device) if cuda else None
    # One more step, profiled: the GPU timeline for exposed communication. Device activity only,
    # so the profiler adds as little host work as possible to the step it observes.
    step = args.warmup + args.steps + args.mem_steps
    batch = rank_batch(mode_args, step, rank, world).to(trainer.device)
    t0 = time.perf_counter()
    timeline = _profiled_step(trainer, batch, device_sync(trainer.device), cuda,
                              result_dir / f"{engine}.{'on' if checkpointing else 'off'}"
                              f"{f'.rank{rank}' if rank else ''}.trace.json",
                              keep=args.keep_traces)
    profile_s = time.perf_counter() - t0
    profiled_wall_s = timeline.pop("wall_s")
    memory = loop["memory"]
    return {
        "ok": True, "device": str(trainer.device), "threads": torch.get_num_threads(), "info": trainer.info,
        "step_times_s": loop["step_times"], "median_step_s": loop["median_step_s"],
        "phase_median_s": loop["phase_median_s"], "losses": losses, "rank0_losses": loop["losses"],
        "micro_batch": mode_args.micro_batch, "world_size": world, "first_step_s": clock.first_s,
        "compile_s": clock.compile_s(loop["median_step_s"]), "dynamo": counts_since(counts),
        "peak_bytes": memory["train_peak_bytes"], "phase_peak_bytes": memory["phase_peak_bytes"],
        "raw_peak_bytes": memory["raw_peak_bytes"], "after_build_bytes": memory["after_build_bytes"],
        "build_peak_bytes": memory["build_peak_bytes"], "baseline_bytes": baseline,
        "reserved_bytes": reserved,
        "memory_method": memory["method"].replace("before engine build", "before the model was built"),
        "engine_breakdown": memory.get("engine_breakdown"),
        "engine_breakdown_by_rank": _gathered(memory.get("engine_breakdown"), world),
        "timeline": timeline, "seconds": {"build": build_s, "loop": loop_s, "profiled_step": profile_s},
        "step_s_profiled": profiled_wall_s,
    }


def _profiled_step(trainer, batch, sync, cuda: bool, trace_path: Path, keep: bool) -> dict:
    """One step under torch.profiler; its GPU timeline summarized (speed_timeline), plus its wall time."""
    from speed_timeline import summarize_file
    from torch.profiler import ProfilerActivity, profile
    from worker import run_step

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run_step(trainer, batch, sync)
        sync()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(trace_path))
    summary = summarize_file(trace_path, "cuda" if cuda else "cpu")
    if cuda and summary["kernels"] == 0:
        # Should a profiler build record no kernels with device activity alone, the step again with host
        # activity too (a little more host overhead in the step it observes, noted).
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_step(trainer, batch, sync)
            sync()
        prof.export_chrome_trace(str(trace_path))
        summary = summarize_file(trace_path, "cuda")
        summary["note"] = "profiled with host activity too (device activity alone recorded no kernels)"
    if not keep:
        trace_path.unlink()
    del prof
    summary["wall_s"] = wall
    return summary


def _preload(engine: str) -> None:
    """Imports what the engine's first mode would (before the go, and outside its memory baseline)."""
    import importlib

    import engines  # noqa: F401
    import torch.profiler  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import worker  # noqa: F401
    from speed_variants import parse_variant

    if parse_variant(engine).compile:
        import torch._dynamo  # noqa: F401 - seconds of imports, outside the column's time
    family = engine.split("-")[0]
    for name in {"zerotrain": ["zerotrain"], "deepspeed": ["deepspeed"],
                 "fsdp2": ["torch.distributed.fsdp", "torch.distributed.device_mesh"]}.get(family, []):
        importlib.import_module(name)


def _init_group(backend: str, cuda: bool) -> None:
    """The default group over `backend` (e.g. Gloo for two ranks on one GPU), before an engine makes its own."""
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=600))


def _mean_over_ranks(losses: list[float], device, world: int) -> list[float]:
    """Each step's loss averaged over the ranks: the global batch's loss (equal-size micro-batches)."""
    import torch
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return losses
    t = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world).tolist()


def _gathered(obj, world: int) -> list | None:
    """Every rank's `obj` (rank order), for the checks that each rank holds its share; None at world 1."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return None
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL if speed.py dies (its own session would otherwise outlive it)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _release(cuda: bool) -> None:
    """Frees what the finished mode left, so the next mode starts from (almost) nothing."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
