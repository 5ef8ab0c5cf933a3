"""One rank of one engine's run: build, warm up, time the steps, measure memory, write JSON.

Started by `run.py` through `torch.distributed.run` (one process per rank, a
fresh process group per engine, so no engine sees another's memory). `train_loop`
and `run_step` are also the GPU speed check's loop (benchmarks/gpu/speed_worker.py).

Steps: `--warmup` untimed, `--steps` timed, then `--mem-steps` untimed steps in
which memory is measured phase by phase (forward, backward, optimizer step).

Memory, per rank, on CPU: resident set size (RSS, /proc/self/status), relative
to VmRSS just before the engine is built around the already-built fp32 model.
* peak (headline): in each memory step, before each phase, free heap memory is
  handed back to the OS (glibc `malloc_trim(0)`) and the RSS high-water mark is
  reset (`echo 5 > /proc/self/clear_refs`); VmHWM at the phase's end is that
  phase's peak. The largest phase peak approximates the most memory the engine
  has live at once (its state + gradients + activations + communication
  buffers), without glibc's habit of keeping freed heap pages resident.
* raw peak: VmHWM over the warm-up and timed steps with the allocator
  untouched, i.e. what `top` would have shown; includes memory glibc retained.
If clear_refs cannot be written, ru_maxrss (process-lifetime peak) stands in.
On CUDA: torch.cuda.max_memory_allocated with the same resets (no trimming
needed), minus memory_allocated before the engine was built.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

PHASES = ("forward", "backward", "step")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


class MemoryProbe:
    def __init__(self, device) -> None:
        import torch

        self.torch, self.device, self.cuda = torch, device, device.type == "cuda"
        self.trim = None if self.cuda else _malloc_trim()
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(device)
            self.method = "torch.cuda.max_memory_allocated - memory_allocated before engine build"
        else:
            self.hwm_ok = _reset_hwm() and _status_kib("VmHWM") is not None
            self.method = ("VmHWM" if self.hwm_ok else "ru_maxrss (process lifetime)") + " - VmRSS before engine build" \
                + (", heap trimmed (malloc_trim) before each measured phase" if self.trim else "")
        self._trim()
        self.base = self.current()
        self.phase_peaks: dict[str, int] = {}
        self._restart_peak()

    def _trim(self) -> None:
        if self.trim is not None:
            self.trim(0)

    def current(self) -> int:
        if self.cuda:
            return self.torch.cuda.memory_allocated(self.device)
        return (_status_kib("VmRSS") or 0) * 1024

    def _peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.max_memory_allocated(self.device)
        if self.hwm_ok:
            return _status_kib("VmHWM") * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _restart_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)
        elif self.hwm_ok:
            _reset_hwm()

    def engine_built(self) -> None:
        """Records the construction peak, then restarts peak tracking for the training loop."""
        self.build_peak = self._peak() - self.base
        self.after_build = self.current() - self.base
        self._restart_peak()

    def timed_steps_done(self) -> None:
        self.raw_peak = self._peak() - self.base

    def phase_start(self) -> None:
        self._trim()
        self._restart_peak()

    def phase_end(self, phase: str) -> None:
        peak = self._peak() - self.base
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, peak), peak)

    def result(self) -> dict:
        return {"method": self.method, "baseline_bytes": self.base, "build_peak_bytes": self.build_peak,
                "after_build_bytes": self.after_build, "raw_peak_bytes": self.raw_peak,
                "train_peak_bytes": max(self.phase_peaks.values()) if self.phase_peaks else self.raw_peak,
                "phase_peak_bytes": self.phase_peaks}


def run_worker(args) -> None:
    rank = int(os.environ.get("RANK", 0))
    out = Path(args.result_dir) / f"{args.worker}.rank{rank}.json"
    try:
        result = _run(args, rank)
    except Exception as exc:  # reported as a skipped column, with the reason
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if "error" not in result else 3)


def _run(args, rank: int) -> dict:
    import torch
    from engines import build
    from workload import build_model, model_device

    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model = build_model(args, device=model_device(args))
    probe = MemoryProbe(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                        if torch.cuda.is_available() else torch.device("cpu"))
    trainer = build(args.worker, model, args)
    del model
    gc.collect()
    probe.engine_built()
    profile_dir = Path(args.result_dir) if args.profile else None
    result = train_loop(trainer, args, rank, world, probe, profile_dir=profile_dir, tag=f"{args.worker}.rank{rank}")
    return {"rank": rank, "world": world, "device": str(trainer.device), "threads": torch.get_num_threads(),
            **result, "info": trainer.info}


def device_sync(device) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA), so a host clock read after it covers that work."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_step(trainer, batch, sync: Callable[[], None], probe: MemoryProbe | None = None):
    """One forward, backward and optimizer step; returns (loss, seconds per phase).

    Each phase is timed between device synchronizations, so its time is the device's work for
    it, not just the host's launching; with `probe`, each phase's memory peak is recorded too.
    """
    spent: dict[str, float] = {}
    loss = None
    for phase in PHASES:
        if probe is not None:
            probe.phase_start()
        sync()
        t0 = time.perf_counter()
        if phase == "forward":
            loss = trainer.forward(batch)
        elif phase == "backward":
            trainer.backward(loss)
        else:
            trainer.step()
        sync()
        spent[phase] = time.perf_counter() - t0
        if probe is not None:
            probe.phase_end(phase)
    return loss, spent


def train_loop(trainer, args, rank: int, world: int, probe: MemoryProbe, profile_dir: Path | None = None,
               tag: str = "") -> dict:
    """The loop every engine runs: `args.warmup` untimed steps, `args.steps` timed ones, then
    `args.mem_steps` steps measuring memory phase by phase; the batches are `rank_batch`'s.

    With `profile_dir`, the timed steps run under torch.profiler and its op table is written there.
    Returns step and phase times, losses and the probe's memory figures.
    """
    import torch
    from workload import rank_batch

    sync = device_sync(trainer.device)
    profiler = None
    if profile_dir is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
    times, phases, losses = [], {k: [] for k in PHASES}, []
    timed = range(args.warmup, args.warmup + args.steps)
    for step in range(args.warmup + args.steps + args.mem_steps):
        if profiler is not None and step == args.warmup:
            profiler.start()
        if step == timed.stop:
            if profiler is not None:
                profiler.stop()
            probe.timed_steps_done()
        batch = rank_batch(args, step, rank, world).to(trainer.device)
        loss, spent = run_step(trainer, batch, sync, probe if step >= timed.stop else None)
        losses.append(float(loss.detach().float()))
        if step in timed:
            times.append(sum(spent.values()))
            for k in PHASES:
                phases[k].append(spent[k])
    if args.mem_steps == 0:
        if profiler is not None:
            profiler.stop()
        probe.timed_steps_done()
    if profiler is not None:
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        Path(profile_dir, f"{tag}.profile.txt").write_text(table)
    memory = probe.result()
    if trainer.memory_breakdown is not None:
        memory["engine_breakdown"] = trainer.memory_breakdown()
    return {
        "step_times": times, "median_step_s": statistics.median(times),
        "phase_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "losses": losses, "memory": memory,
    }
