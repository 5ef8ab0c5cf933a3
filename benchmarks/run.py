#!/usr/bin/env python
"""zerotrain vs torch DDP, torch FSDP2 and DeepSpeed on one small Llama job, side by side.

    python benchmarks/run.py [--nproc 2] [--steps 20] [--out results.json] [--markdown results.md]

Each engine runs in its own fresh set of N processes (torch.distributed.run),
with the same OMP_NUM_THREADS, model init seed, data, optimizer (torch AdamW,
foreach), clipping and dtype. Per engine: median step time (slowest rank per
step) over the timed steps after warm-up, pooled over --repeats runs; tokens/s;
peak memory per rank (see worker.py for exactly what is measured); first and
final loss. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from machine import busy_cpu_s, own_children_cpu_s, resolve_machine, wait_idle  # noqa: E402
from engines import ENGINES, EXTRA_ENGINES  # noqa: E402
from report import MIB, add_ratios, markdown, print_rich, targets  # noqa: E402
from workload import add_workload_args, param_count, resolve_sizes  # noqa: E402

BUSY_CORES = 0.2  # other processes' CPU use (cores) above which a run counts as disturbed
PASSED_TO_WORKERS = ["warmup", "steps", "mem_steps", "profile"]  # besides every workload argument


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated subset of {ENGINES}, or also {EXTRA_ENGINES}")
    p.add_argument("--nproc", type=int, default=None, help="ranks per engine (default 2; CUDA: min(2, GPUs))")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every rank of every engine (default: CPU cores // nproc, at least 1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA (NCCL, one rank per GPU) when available, else CPU (Gloo)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--mem-steps", type=int, default=2,
                   help="untimed steps after the timed ones in which peak memory is measured phase by phase")
    p.add_argument("--repeats", type=int, default=3,
                   help="run the whole engine list this many times (interleaved); an engine's step time is the median "
                        "over the timed steps of all its runs, runs disturbed by other processes left out")
    p.add_argument("--wait-idle", type=float, default=30,
                   help="CPU runs: before each engine, wait up to this many seconds for other processes to use "
                        "< 0.25 core (0: don't wait); the load seen during each run is recorded either way")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run before it is killed")
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--markdown", help="write the markdown tables here ('-' for stdout)")
    p.add_argument("--profile", action="store_true",
                   help="run the timed steps under torch.profiler; per-rank op tables go to the logs folder "
                        "(timings then include profiler overhead)")
    p.add_argument("--logs", help="keep each engine's stdout/stderr in this folder (default: a temp folder)")
    p.workload_dests = {a.dest for a in add_workload_args(p)._group_actions}
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    resolve_sizes(args)  # sizes left out come from --model-config (or the built-in job), for workers and report
    return p, args


def worker_argv(parser, args) -> list[str]:
    """The workload flags, re-spelled for the worker processes."""
    out = []
    for action in parser._actions:
        if action.dest in PASSED_TO_WORKERS or action.dest in parser.workload_dests:
            value = getattr(args, action.dest)
            if value is None:  # an optional setting left out (e.g. --model-config)
                continue
            if action.nargs == 0:  # a store_true flag
                out += [action.option_strings[0]] if value else []
            else:
                out += [action.option_strings[0], str(value)]
    return out


def launch(name: str, parser, args, machine: dict, result_dir: Path, log_dir: Path) -> dict:
    """Runs one engine on N fresh processes; returns its per-rank results merged.

    Also measures the CPU other processes on the machine used meanwhile (busy time
    from /proc/stat minus this harness's own children), since on a shared machine
    that, not the engine, can dominate a step-time difference.
    """
    for f in result_dir.glob(f"{name}.rank*.json"):
        f.unlink()
    idle_before = None
    if args.wait_idle > 0 and not machine["cuda"]:
        idle_before = wait_idle(args.wait_idle, lambda load: print(
            f"(other processes use {load:.1f} cores; waiting up to {args.wait_idle:.0f}s for quiet)", end=" ", flush=True))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc_per_node={args.nproc}", str(HERE / "run.py"), "--worker", name,
           "--result-dir", str(result_dir), *worker_argv(parser, args)]
    log = log_dir / f"{name}.log"
    start = time.perf_counter()
    busy0, own0 = busy_cpu_s(), own_children_cpu_s()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, env=machine["env"], stdout=fh, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    foreign = max(0.0, (busy_cpu_s() - busy0) - (own_children_cpu_s() - own0)) / wall
    ranks = [json.loads(f.read_text()) for f in sorted(result_dir.glob(f"{name}.rank*.json"))]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or len(ranks) != args.nproc:
        reason = errors[0] if errors else f"exit {rc}, {len(ranks)}/{args.nproc} ranks reported (log: {log})"
        return {"ok": False, "reason": reason[:300], "wall_s": wall, "log": str(log)}
    return {**merge(ranks, args, wall, log), "foreign_load_cores": foreign, "foreign_load_before": idle_before}


def merge(ranks: list[dict], args, wall: float, log: Path) -> dict:
    steps = len(ranks[0]["step_times"])
    slowest = sorted(max(r["step_times"][i] for r in ranks) for i in range(steps))
    step_s = statistics.median(slowest)
    q = statistics.quantiles(slowest, n=4) if steps > 1 else [step_s, step_s, step_s]
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(len(ranks[0]["losses"]))]
    mem = [r["memory"] for r in ranks]
    tokens = args.nproc * args.micro_batch * args.seq
    return {
        "ok": True, "wall_s": wall, "log": str(log),
        "step_ms": step_s * 1e3, "step_ms_p25": q[0] * 1e3, "step_ms_p75": q[2] * 1e3,
        "step_series_ms": [max(r["step_times"][i] for r in ranks) * 1e3 for i in range(steps)],
        "phase_ms": {k: statistics.fmean(r["phase_median_s"][k] for r in ranks) * 1e3
                     for k in ("forward", "backward", "step")},
        "tokens_per_s": tokens / step_s,
        "peak_mib": max(m["train_peak_bytes"] for m in mem) / MIB,
        "build_peak_mib": max(m["build_peak_bytes"] for m in mem) / MIB,
        "after_build_mib": max(m["after_build_bytes"] for m in mem) / MIB,
        "raw_peak_mib": max(m["raw_peak_bytes"] for m in mem) / MIB,
        "phase_peak_mib": {k: max(m["phase_peak_bytes"].get(k, 0) for m in mem) / MIB
                           for k in ("forward", "backward", "step")},
        "loss_first": losses[0], "loss_final": losses[-1], "losses": losses,
        "trains": losses[-1] < losses[0] - 0.5,
        "memory_method": mem[0]["method"], "engine_breakdown": mem[0].get("engine_breakdown"),
        "info": ranks[0]["info"], "threads": ranks[0]["threads"], "device": ranks[0]["device"],
        "per_rank": [{k: r[k] for k in ("rank", "median_step_s", "phase_median_s", "memory")} for r in ranks],
    }


def pool_runs(runs: list[dict], args) -> dict:
    """One row per engine from its repeats: step time statistics over the timed steps of all
    runs pooled; memory, phases and losses from the run whose own median step time is the median."""
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return runs[-1]
    # Runs during which other processes took CPU measure them, not the engine: dropped
    # while at least one clean run remains (and counted in the row).
    clean = [r for r in ok if r.get("foreign_load_cores", 0) <= BUSY_CORES]
    dropped = len(ok) - len(clean) if clean else 0
    ok = clean or ok
    mid = sorted(ok, key=lambda r: r["step_ms"])[len(ok) // 2]
    pooled = sorted(t for r in ok for t in r["step_series_ms"])
    q = statistics.quantiles(pooled, n=4) if len(pooled) > 1 else [pooled[0]] * 3
    peaks = [r["peak_mib"] for r in ok]
    return {**mid, "step_ms": statistics.median(pooled), "step_ms_p25": q[0], "step_ms_p75": q[2],
            "tokens_per_s": args.nproc * args.micro_batch * args.seq / statistics.median(pooled) * 1e3,
            "peak_mib": sorted(peaks)[len(peaks) // 2], "repeats": len(ok), "dropped_busy_runs": dropped,
            "runs_step_ms": [r["step_ms"] for r in ok], "runs_peak_mib": peaks}


def main(argv=None) -> None:
    parser, args = parse_args(argv)
    if args.worker:
        from worker import run_worker

        return run_worker(args)
    machine = resolve_machine(args)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = set(names) - set(ENGINES) - set(EXTRA_ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES + EXTRA_ENGINES}")
    if "plain" in names and args.nproc != 1:
        parser.error("plain is one process with no process group: run it with --nproc 1")
    notes = []
    has_ds = importlib.util.find_spec("deepspeed") is not None
    if not has_ds and any(n.startswith("deepspeed") for n in names):
        notes.append("deepspeed is not importable in this environment: DeepSpeed columns skipped "
                     "(`make bench` installs it in .venv-bench)")
    # Per-rank JSON, logs and profiles all go to one folder: --logs, or a fresh temp folder.
    result_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="zerotrain-bench-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    log_dir = result_dir
    v = machine["versions"]
    job = (f"Llama {param_count(args) / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
           f"seq {args.seq}, micro batch {args.micro_batch}/rank, {args.nproc} ranks, {args.dtype}, "
           f"AdamW lr {args.lr} + clip {args.clip}, {args.warmup} warm-up + {args.steps} timed steps, "
           f"{args.repeats} run(s) per engine")
    meta = {
        "job": job,
        "machine": f"{machine['device']}, OMP_NUM_THREADS={args.threads}, torch {v['torch']}, "
                   f"zerotrain {v['zerotrain']} @ {v['zerotrain_commit'] or '?'}, "
                   f"DeepSpeed {v['deepspeed'] or 'not installed'}, transformers {v['transformers']}, "
                   f"Python {v['python']}",
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable), *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "omp_num_threads": args.threads, "nproc": args.nproc, "versions": v, "notes": notes,
        "memory_method": (
            "peak memory/rank = torch.cuda.max_memory_allocated during the memory-measuring steps, per phase "
            "(forward/backward/step), minus memory_allocated before the engine was built" if machine["cuda"] else
            "peak memory/rank = largest RSS high-water mark (VmHWM) of any phase (forward/backward/optimizer step) "
            f"in {args.mem_steps} steps after the timed ones, with glibc's free heap handed back (malloc_trim) and "
            "VmHWM reset before each phase, minus VmRSS just before the engine was built around the fp32 model; "
            "'raw peak' = VmHWM over warm-up + timed steps with the allocator untouched"),
    }
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            if name.startswith("deepspeed") and not has_ds:
                runs[name].append({"ok": False, "reason": "deepspeed not installed"})
                continue
            tag = f" (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"[bench] {name}{tag} on {args.nproc} ranks ...", end=" ", flush=True)
            r = launch(name, parser, args, machine, result_dir, log_dir)
            print(f"{r['step_ms']:.1f} ms/step, final loss {r['loss_final']:.3f} ({r['wall_s']:.0f}s, "
                  f"other processes used {r['foreign_load_cores']:.2f} cores meanwhile)"
                  if r["ok"] else f"skipped: {r['reason']}", flush=True)
            runs[name].append(r)
    results = {n: pool_runs(rs, args) for n, rs in runs.items()}
    add_ratios(results)
    ref = results.get("ddp", {})
    for n, r in results.items():
        if r.get("ok") and not r["trains"]:
            notes.append(f"{n}: loss did not fall by 0.5 ({r['loss_first']:.3f} -> {r['loss_final']:.3f})")
        if r.get("ok") and ref.get("ok") and abs(r["loss_final"] - ref["loss_final"]) > 0.01 * abs(ref["loss_final"]):
            notes.append(f"{n}: final loss {r['loss_final']:.3f} differs from DDP's {ref['loss_final']:.3f} by more "
                         "than 1%")
        if n.startswith("deepspeed") and r.get("ok"):
            meta.setdefault("deepspeed_backend", r["info"].get("backend"))
    if "deepspeed_backend" in meta:
        notes.append(f"DeepSpeed's communication backend here: {meta['deepspeed_backend']} "
                     f"(DS_ACCELERATOR={machine['env'].get('DS_ACCELERATOR', 'auto')}); optimizer "
                     + ", ".join(f"{n}: {r['info']['optimizer']}" for n, r in results.items() if r.get("ok")))
    offloads = {n: r["info"]["offload"] for n, r in results.items() if r.get("ok") and r["info"].get("offload")}
    if offloads:
        notes.append("offload as each engine parsed its config: "
                     + ", ".join(f"{n}: {o}" for n, o in offloads.items()))
    busy = {n: r["foreign_load_cores"] for n, r in results.items() if r.get("foreign_load_cores", 0) > BUSY_CORES}
    if busy:
        notes.append("other processes were using CPU during " + ", ".join(f"{n} ({v:.2f} cores)" for n, v in busy.items())
                     + ": those step times are inflated; rerun on a quiet machine")
    dropped = {n: r["dropped_busy_runs"] for n, r in results.items() if r.get("dropped_busy_runs")}
    if dropped:
        notes.append("runs left out because other processes used more than "
                     f"{BUSY_CORES} core meanwhile: " + ", ".join(f"{n} {k}" for n, k in dropped.items()))
    threads = {n: r["threads"] for n, r in results.items() if r.get("ok") and r["threads"] != args.threads}
    if threads:
        notes.append(f"torch thread count differed from OMP_NUM_THREADS={args.threads}: {threads}")
    tgts = targets(results)
    print_rich(results, tgts, meta)
    for path in (args.out, args.markdown):
        if path and path != "-":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "targets": tgts}, indent=1))
    if args.markdown:
        text = markdown(results, tgts, meta)
        sys.stdout.write(text) if args.markdown == "-" else Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
