#!/usr/bin/env python
"""GPU check, speed: plain torch, zerotrain stages 0-3, DeepSpeed stages 0-3 and FSDP2 on one
~1B Llama (benchmarks/gpu/llama-1b.json, random weights), bf16, seq 2048, SDPA, eager and compiled
(zerotrain and DeepSpeed by `engine.compile()`, FSDP2 by per-block compile), at the chosen micro-batch
and at micro-batch 2, activation checkpointing off (and on, if asked), in one run; writes speed.json and
speed.md (tables for docs/benchmarks.md). A column is "<engine>[-compile][-mb2]" (speed_variants.py).

    python benchmarks/gpu/speed.py --out-dir runs/gpu-check           # one GPU (within a 540 s budget)
    python benchmarks/gpu/speed.py --out-dir runs/gpu-check --dry     # CPU smoke run, tiny sizes (GPU_CHECK_DRY=1 too)
    python benchmarks/gpu/speed.py --out-dir /tmp/smoke --dry --device cuda   # the dry sizes on the GPU: CUDA paths

Per engine one fresh process (a world of one: NCCL on a GPU, Gloo on a CPU; the dry run puts five
engines in a process, one after the other: there its imports cost more than its steps) runs both
checkpointing modes: model built on the device from one seed, the harness's loop (benchmarks/worker.py)
for warm-up, timed and memory steps, then one profiled step for the GPU timeline. Reported per engine
and mode: tokens/s, MFU, forward/backward/optimizer-step times, exposed communication, peak GPU
memory against the planner's prediction, losses; and the targets, met or NOT met. See
benchmarks/README.md. Exit status: 0 when the harness ran (missed targets are reported, not
failed), 1 when a zerotrain column failed, hung or was not run, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
sys.path.append(str(HERE.parent.parent))  # this checkout's zerotrain when none is installed (a bare GPU machine)

# speed_launch first: its clock, which the progress lines count from, starts with the run.
from speed_launch import say  # noqa: E402
from speed_variants import column_names  # noqa: E402
from workload import add_workload_args  # noqa: E402

BASE_ENGINES = ["plain", "zerotrain-0", "zerotrain-1", "zerotrain-2", "zerotrain-3",
                "deepspeed-0", "deepspeed-1", "deepspeed-2", "deepspeed-3", "fsdp2"]
ENGINES = column_names(BASE_ENGINES)
# The default columns, most wanted first (a spent budget cuts the tail, reported as not run): the issue's
# targets need the compiled stages 0 and 3 beside their compiled peers, and micro-batch 2 at stages 0 and 3.
GPU_COLUMNS = ["zerotrain-0-compile", "zerotrain-3-compile", "fsdp2-compile", "deepspeed-3-compile",
               "deepspeed-0-compile", "zerotrain-3-compile-mb2", "zerotrain-0-compile-mb2",
               "zerotrain-0", "zerotrain-3", "plain", "fsdp2", "deepspeed-3", "zerotrain-3-mb2", "zerotrain-0-mb2",
               "deepspeed-0", "zerotrain-1", "zerotrain-2", "deepspeed-1", "deepspeed-2"]
# The dry run: each path once (engine.compile, per-block compile, DeepSpeed's, micro-batch 2); a compiled
# column costs ~20 s of tracing per mode on 2 CPU cores.
DRY_COLUMNS = BASE_ENGINES + ["zerotrain-3-compile", "fsdp2-compile", "deepspeed-3-compile", "zerotrain-0-mb2"]
MODES = ("off", "on")
# Dry runs: the same model config with these sizes (0.1M parameters: bf16 matmuls are slow on CPUs
# without AVX-512, and twelve engine-modes must stay well under a minute on 2 cores; the loss still
# falls within the 3 steps), and a short loop.
DRY_SIZES = {"vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}
#    seq, micro-batch, warm-up, timed, per-engine timeout s, whole-run budget s, engines per process, modes
DEFAULTS = {"gpu": (2048, None, 3, 8, 180, 540, 1, "off"), "dry": (64, 2, 1, 2, 120, 300, 5, "off,on")}
# torch.compile's backend: inductor on a GPU; the dry run's aot_eager traces the same graphs (dynamo, AOT
# autograd) without inductor's code generation, which takes minutes of gcc on 2 CPU cores.
COMPILE_BACKEND = {"gpu": "inductor", "dry": "aot_eager"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", help="writes speed.json, speed.md and speed-logs/ here")
    p.add_argument("--dry", action="store_true", help="tiny sizes on the CPU (also: env GPU_CHECK_DRY=1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="default: cuda (auto) for the real run, cpu for --dry")
    p.add_argument("--engines", default=None,
                   help=f"comma-separated columns: an engine of {BASE_ENGINES}, optionally with -compile and/or "
                        f"-mb2 (default: {','.join(GPU_COLUMNS)}; dry: {','.join(DRY_COLUMNS)})")
    p.add_argument("--checkpointing-modes", default=None, help="off, on or both (off,on); default off (dry: off,on)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the -compile columns (default inductor; dry aot_eager)")
    p.add_argument("--world", type=int, default=1,
                   help="ranks per column (one per GPU; the multi-GPU part, multi.py); default 1")
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage3_param_persistence_threshold for zerotrain and DeepSpeed (default: theirs, 1e5; "
                        "multi.py's memory check gives 0, so a small model's parameters are sharded too)")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="with --world > 1: the process group's backend (default: the engine's; gloo lets two "
                        "ranks share one GPU, which NCCL refuses)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (default 3; dry 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 8; dry 2)")
    p.add_argument("--mem-steps", type=int, default=1, help="steps after the timed ones measuring memory per phase")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per engine, from its process's go (default 180; dry 120)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="whole run (default 540; dry 300): engines not started by then are reported as not run")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak for MFU (default: looked up from the GPU's name)")
    p.add_argument("--memory-fraction", type=float, default=0.70,
                   help="--micro-batch auto: the share of GPU memory the planner's stage-0 prediction may take")
    p.add_argument("--split-modes", action="store_true", help="one process per engine and mode (slower)")
    p.add_argument("--engines-per-process", type=int, default=None,
                   help="engines run one after the other in one process (default 1; dry 5: a process's imports "
                        "cost more than a dry engine's steps)")
    p.add_argument("--keep-traces", action="store_true", help="keep each profiled step's Chrome trace in the logs")
    add_workload_args(p)
    p.set_defaults(model_config=str(HERE / "llama-1b.json"), dtype="bf16", init_device="device",
                   seq=None, micro_batch=None)
    for action in p._actions:  # the workload flags whose meaning differs here
        if action.dest == "checkpointing":
            action.help = argparse.SUPPRESS  # --checkpointing-modes decides, per mode
        elif action.dest == "micro_batch":
            action.help = "sequences per step (default: auto, the planner's choice for the GPU; dry 2)"
        elif action.dest == "seq":
            action.help = "sequence length (default 2048; dry 64)"
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--modes", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--go-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if not args.out_dir:
        p.error("--out-dir is required")
    args.dry = args.dry or os.environ.get("GPU_CHECK_DRY", "").lower() in ("1", "true", "yes")
    kind = "dry" if args.dry else "gpu"
    seq, mb, warmup, steps, timeout, budget, per_process, modes = DEFAULTS[kind]
    per_process = 1 if args.split_modes else per_process
    for name, value in (("seq", seq), ("micro_batch", mb), ("warmup", warmup), ("steps", steps),
                        ("timeout", timeout), ("budget_s", budget), ("engines_per_process", per_process),
                        ("checkpointing_modes", modes), ("compile_backend", COMPILE_BACKEND[kind]),
                        ("engines", ",".join(DRY_COLUMNS if args.dry else GPU_COLUMNS))):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dry:
        for name, value in DRY_SIZES.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    args.device = args.device or ("cpu" if args.dry else "auto")
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.mode_list = [m.strip() for m in args.checkpointing_modes.split(",") if m.strip()]
    bad = [e for e in args.engine_list if e not in ENGINES] + [m for m in args.mode_list if m not in MODES]
    if bad:
        p.error(f"unknown engines or modes {bad}; engines: {ENGINES}, modes: {list(MODES)}")
    if args.engines_per_process < 1 or (args.engines_per_process > 1 and args.split_modes):
        p.error("--engines-per-process: 1 or more (1 with --split-modes: one process per engine and mode)")
    if args.world < 1 or (args.world > 1 and any(e.startswith("plain") for e in args.engine_list)):
        p.error("--world: 1 or more; plain torch runs a world of 1 only (with N ranks it would run N copies)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        from speed_worker import run

        run(args.worker.split(","), args.settings, args.modes.split(","), args.result_dir, args.go_file)
        return 0  # not reached: the worker exits the process
    return orchestrate(args)


def orchestrate(args) -> int:
    from machine import worker_env
    from speed_launch import EngineProcess

    started = time.perf_counter()
    # Dry runs: one thread per process. Tiny matmuls gain nothing from two, and the next engine's process
    # imports meanwhile: two OpenMP threads spinning against it on 2 cores cost seconds per step.
    args.nproc, args.threads = 1, (1 if args.dry else max(1, (os.cpu_count() or 1) // args.world))
    if args.device == "auto" and args.dry:  # the workers' environment depends on it (real runs need CUDA)
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    env = worker_env(args.threads, cuda=args.device != "cpu")
    out_dir = Path(args.out_dir)
    logs = out_dir / "speed-logs"
    logs.mkdir(parents=True, exist_ok=True)
    settings_file = logs / "settings.json"
    settings_file.unlink(missing_ok=True)
    ds_missing = _deepspeed_missing()
    results, jobs = _jobs(args, ds_missing)
    # The first engine's process imports while this one imports torch and plans; it reads the
    # settings only after its go.
    first = EngineProcess(*jobs[0], env, settings_file, logs, world=args.world) if jobs else None
    try:
        return _orchestrate(args, started, env, out_dir, logs, settings_file, ds_missing, results, jobs, first)
    finally:
        if first is not None and first.proc.poll() is None and not first.go_file.exists():
            first.kill()  # never let go (a usage error, an interrupt)


def _orchestrate(args, started, env, out_dir, logs, settings_file, ds_missing, results, jobs, first) -> int:
    import torch
    from machine import resolve_machine
    from speed_expect import budget_line, choose_micro_batch, peak_tflops
    from speed_report import build_report, markdown
    from workload import llama_config, param_count

    if args.device != "cpu" and not torch.cuda.is_available() and (args.device == "cuda" or not args.dry):
        print("speed.py: no CUDA device visible; the speed check needs a GPU (use --dry for the CPU smoke run)",
              file=sys.stderr)
        return 2
    machine = resolve_machine(args)
    args.device = "cuda" if machine["cuda"] else "cpu"
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if machine["cuda"] else None
    cfg = llama_config(args)
    mb_reason = "dry run" if args.dry else "given (--micro-batch)"
    if not args.micro_batch:
        args.micro_batch, mb_reason = choose_micro_batch(args, cfg, gpu_memory, args.memory_fraction)
    if args.peak_tflops:
        peak, peak_source = args.peak_tflops, "--peak-tflops"
    elif machine["cuda"]:
        peak, peak_source = peak_tflops(machine["device"])
    else:
        peak, peak_source = None, "CPU run: no dense bf16 peak (pass --peak-tflops)"
    # The planner's predictions and the FLOP count run on the CPU while the engines run: only the
    # progress lines and the report need them.
    pool = concurrent.futures.ThreadPoolExecutor(1)
    expected = pool.submit(_expectations, args, cfg, gpu_memory)
    settings = {k: v for k, v in vars(args).items() if k not in ("engine_list", "mode_list")}
    settings_file.write_text(json.dumps(settings, indent=1))
    say(f"{machine['device']}: Llama {param_count(args) / 1e6:,.1f}M params, seq {args.seq}, micro-batch "
        f"{args.micro_batch} ({mb_reason}), {args.dtype}, {args.warmup} warm-up + {args.steps} timed steps, "
        f"checkpointing {'/'.join(args.mode_list)}, {args.threads} threads/process, world {args.world}"
        f"{' over ' + args.backend if args.backend else ''}; logs in {logs}")
    if any("-compile" in e for e in args.engine_list):
        say(f"compiled columns: torch.compile backend {args.compile_backend}"
            + (" (the dry run's: inductor's code generation is too slow on 2 CPU cores)" if args.dry else ""))
    say(budget_line(args.engine_list, args.mode_list, args.budget_s, args.dry))

    def write(final: bool) -> dict:
        """speed.json and speed.md from what has run so far (a killed run still leaves its rows)."""
        predictions, flops = expected.result() if final or expected.done() else ({}, None)
        meta = {
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "python": sys.executable,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "complete": final,
            "dry": args.dry, "device": machine["device"], "device_memory_bytes": gpu_memory,
            "peak_tflops": peak, "peak_source": peak_source, "versions": machine["versions"],
            "omp_num_threads": args.threads, "micro_batch_reason": mb_reason,
            "wall_s": time.perf_counter() - started, "deepspeed": ds_missing or "installed",
            "compile_backend": args.compile_backend, "world_size": args.world, "backend": args.backend,
        }
        report = build_report(args, meta, results, flops, predictions)
        (out_dir / "speed.json").write_text(json.dumps(report, indent=1))
        (out_dir / "speed.md").write_text(markdown(report))
        return report

    run_engines(args, jobs, first, results, env, settings_file, logs, started, expected, peak,
                after_each=lambda: write(final=False))
    report = write(final=True)
    pool.shutdown()
    print(markdown(report))
    say(f"wrote {out_dir / 'speed.json'} and {out_dir / 'speed.md'}")
    return 0 if report["zerotrain_ok"] else 1


def _jobs(args, ds_missing: str | None) -> tuple[dict[str, dict[str, dict]], list[tuple[list[str], list[str]]]]:
    """(results holding the rows of engines that cannot run here, [(engines, modes) per process to start])."""
    results: dict[str, dict[str, dict]] = {e: {} for e in args.engine_list}
    runnable = []
    for engine in args.engine_list:
        if engine.startswith("deepspeed") and ds_missing:
            results[engine] = {m: {"ok": False, "skipped": True, "reason": ds_missing} for m in args.mode_list}
        else:
            runnable.append(engine)
    if args.split_modes:
        return results, [([engine], [m]) for engine in runnable for m in args.mode_list]
    n = args.engines_per_process
    return results, [(runnable[i:i + n], args.mode_list) for i in range(0, len(runnable), n)]


def _expectations(args, cfg, gpu_memory: int | None):
    """({prediction_key: planner GPU bytes or None}, StepFlopCount at the run's micro-batch) for the selected
    columns and modes."""
    from speed_expect import count_flops, planner_stage, predict_gpu_bytes, prediction_key
    from speed_variants import column_micro_batch

    predictions: dict[str, int | None] = {}
    for engine in args.engine_list:
        stage, mb = planner_stage(engine), column_micro_batch(engine, args.micro_batch)
        for mode in args.mode_list:
            key = prediction_key(engine, mode, args.micro_batch)
            if stage is None or key in predictions:
                continue
            try:
                predictions[key] = predict_gpu_bytes(args, cfg, stage, mode == "on", mb, gpu_memory, args.world)
            except Exception as exc:  # noqa: BLE001 - the rows then show no prediction; the run goes on
                predictions[key] = None
                say(f"planner prediction for stage {stage}, checkpointing {mode}, micro-batch {mb} failed: {exc}")
    return predictions, count_flops(cfg, args.micro_batch, args.seq)


def run_engines(args, jobs, first, results: dict[str, dict[str, dict]], env: dict, settings_file: Path, logs: Path,
                started: float, expected: concurrent.futures.Future, peak: float | None, after_each) -> None:
    """Runs the jobs in order within the time budget, filling `results` ({engine: {mode: result}}).

    The next engine's process starts (and imports) while the current one runs; see speed_launch.
    """
    from speed_expect import prediction_key
    from speed_launch import EngineProcess
    from speed_report import progress_line

    for engine, by_mode in results.items():
        if by_mode:
            say(f"{engine}: not run ({next(iter(by_mode.values()))['reason']})")

    def report(engine: str, mode: str, r: dict) -> None:
        predictions, flops = expected.result() if expected.done() else ({}, None)
        say(progress_line(engine, mode, r, args, flops, peak,
                          predictions.get(prediction_key(engine, mode, args.micro_batch))))

    pending = first
    try:
        for i, (engines, modes) in enumerate(jobs):
            current, pending = pending, None
            remaining = args.budget_s - (time.perf_counter() - started)
            if remaining < min(30.0, args.timeout):
                current.kill()
                why = f"not run: the time budget (--budget-s {args.budget_s:.0f}) was spent"
                for later_engines, later_modes in jobs[i:]:
                    for later in later_engines:
                        results[later].update({m: {"ok": False, "skipped": True, "reason": why} for m in later_modes})
                say(f"{why}: {', '.join(dict.fromkeys(e for es, _ in jobs[i:] for e in es))}")
                break
            if i + 1 < len(jobs):
                pending = EngineProcess(*jobs[i + 1], env, settings_file, logs, world=args.world)
            for engine, by_mode in current.run(min(args.timeout * len(engines), remaining), report).items():
                results[engine].update(by_mode)
            after_each()
    finally:
        if pending is not None:  # an interrupted run leaves no process waiting for its go
            pending.kill()


def _deepspeed_missing() -> str | None:
    """Why the DeepSpeed columns cannot run here, or None. zerotrain's own `deepspeed` stand-in is no DeepSpeed."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        return "deepspeed is not installed in this environment"
    if spec.origin and "zerotrain" in Path(spec.origin).parts and "standin" in Path(spec.origin).parts:
        return "the importable deepspeed is zerotrain's stand-in, not DeepSpeed"
    return None


if __name__ == "__main__":
    sys.exit(main())
