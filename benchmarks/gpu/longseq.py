"""GPU check, longseq part: the longest sequence one GPU trains, plain ZeRO-3 against ALST (issue 37, section 5).

For a Llama-3.2-1B shape and a Llama-3.1-8B shape (random weights, bf16, micro-batch 1, 3 steps
a length) and each mode (longseq_shapes.py: plain ZeRO-3 with checkpointing; the same with tiled
MLP + chunked loss + activation offload), search the longest length that trains (doubling, then
bisection: longseq_search.py), with step time and peak memory at every length tried; the
planner's predicted maximum (`zerotrain plan MODEL --max-seq-len`, longseq_plan.py) stands
beside the measured one. Each mode runs the ZeRO-3 rung (optimizer / parameter offload) the
planner picks for it on this machine.

    python benchmarks/gpu/longseq.py --out-dir runs/gpu            # on the GPU machine
    GPU_CHECK_DRY=1 python benchmarks/gpu/longseq.py --out-dir /tmp/x  # dry: CPU, Gloo, tiny shapes

Every trial is a fresh, watched process (size_watch.py): an OOM ends that trial only. A
wall-clock budget (--budget-s) bounds the run: each search gets an equal share of what is left,
and lengths predicted not to finish in it are reported as not tried. Writes OUT_DIR/longseq.json
and longseq.md (trial logs in OUT_DIR/longseq-logs/). Exit status: 0 when the searches ran (a
missed target is reported, not an exit code); 1 when some mode trained no length; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longseq_search import LengthSearch
from longseq_shapes import DRY_SHAPES, GPU_SHAPES, MODES, switches
from size import limits_for, machine
from size_launch import Limits, trial_env
from size_watch import run_watched

GIB, MIB = 2**30, 2**20
TRIAL = Path(__file__).resolve().parent / "longseq_trial.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--dry", action="store_true", help="CPU dry run (also GPU_CHECK_DRY=1)")
    names = [s.name for s in GPU_SHAPES]
    p.add_argument("--shapes", help=f"comma list (default: {','.join(names)}; dry: the tiny ones)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--budget-s", type=float, help="wall-clock budget of the whole run (default 480; dry 90)")
    p.add_argument("--trial-timeout-s", type=float, help="limit of one trial (default 240; dry 45)")
    p.add_argument("--start", type=int, help="first length of the plain search (default: half the planner's "
                   "prediction, at least 4,096; dry: the cap). ALST starts at twice plain's longest")
    p.add_argument("--cap", type=int, help="longest length tried (default 4,194,304; dry 256)")
    p.add_argument("--steps", type=int, default=3, help="steps per trial (default 3)")
    p.add_argument("--host-limit-gib", type=float, help="GPU: cap the host memory a trial may take; dry: the "
                   "fake host limit on a trial's RSS growth (default 0.5 GiB: at the dry lengths"
                   " ~140 MiB of a trial's growth is start-up, so the dry run rehearses the steps, not a limit)")
    args = p.parse_args(argv)
    args.dry = args.dry or os.environ.get("GPU_CHECK_DRY", "") not in ("", "0")
    d = args.dry
    args.budget_s = args.budget_s or (90.0 if d else 480.0)
    args.trial_timeout_s = args.trial_timeout_s or (45.0 if d else 240.0)
    args.cap = args.cap or (256 if d else 1 << 22)
    args.grain = 64 if d else 1024
    if d and args.host_limit_gib is None:
        args.host_limit_gib = 0.5
    pool = DRY_SHAPES if d else GPU_SHAPES
    wanted = args.shapes.split(",") if args.shapes else [s.name for s in pool[:1 if d else None]]
    args.shapes = [s for s in pool if s.name in wanted]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [w for w in wanted if w not in {s.name for s in pool}] + [m for m in args.modes if m not in MODES]
    if bad or not args.shapes or not args.modes:
        p.error(f"unknown or empty --shapes/--modes: {bad} (shapes: {', '.join(s.name for s in pool)})")
    return args


def run_trial(search: LengthSearch, shape, plan: dict, seq: int, args, limits: Limits, timeout_s: float,
              log_dir: Path, budget_cut: bool) -> dict:
    """One length in a watched child process; its record: the child's measurements, or why it failed."""
    stem = f"{shape.name}.{search.mode}.{seq}"
    out, log, baseline = log_dir / f"{stem}.json", log_dir / f"{stem}.log", log_dir / f"{stem}.json.baseline"
    cmd = [sys.executable, str(TRIAL), "--shape", json.dumps(shape.as_dict()),
           "--switches", json.dumps(switches(search.mode, args.dry)), "--config", json.dumps(plan["config"]),
           "--seq", str(seq), "--steps", str(args.steps), "--device", "cpu" if args.dry else "cuda", "--out", str(out)]
    watched = run_watched(cmd, trial_env(not args.dry, 1 if args.dry else max(1, (os.cpu_count() or 2) // 2)), log,
                          timeout_s, limits.floor_bytes, limits.rss_limit_bytes, baseline)
    baseline.unlink(missing_ok=True)
    child = json.loads(out.read_text()) if out.exists() else {}
    base = child.get("baseline_rss_bytes") or watched.baseline_rss_bytes or 0
    rss_peak = max(child.get("host_peak_rss_bytes") or 0, watched.peak_rss_bytes)
    record = {"seq": seq, "wall_s": round(watched.wall_s, 2), "log": log.name,
              "host_peak_bytes": watched.peak_host_used_bytes if not args.dry else max(0, rss_peak - base)}
    for key in ("step_s", "median_step_s", "tokens_per_s", "losses", "gpu_peak_bytes", "gpu_peak_reserved_bytes",
                "phase", "error"):
        if key in child:
            record[key] = child[key]
    if child.get("status") == "ok" and not (watched.killed or "").startswith("host"):
        record.update(status="ok", reason=None)
        if limits.rss_limit_bytes is not None and record["host_peak_bytes"] > limits.rss_limit_bytes:
            record.update(status="failed", reason="host memory", detail="RSS growth over the fake limit (VmHWM)")
    elif watched.killed:
        timeout = watched.killed.startswith("timeout")
        record.update(status="failed", reason=("budget" if budget_cut else "timeout") if timeout else "host memory",
                      detail=watched.killed)
    elif child:
        record.update(status="failed", reason=child.get("reason", "error"), detail=child.get("error", ""))
    else:
        killed = watched.returncode == -9  # not ours: the kernel's OOM killer
        record.update(status="failed", reason="host memory" if killed else "error",
                      detail=f"exited {watched.returncode} without a result")
    return record


def search_all(args, facts: dict, limits: Limits, plans: dict, log_dir: Path, t0: float) -> list[LengthSearch]:
    """Every shape's searches, in order; each gets an equal share of the budget left when it starts."""
    order = [(shape, mode) for shape in args.shapes for mode in args.modes]
    searches = []
    for i, (shape, mode) in enumerate(order):
        plan = plans[shape.name][mode]
        plain = next((s for s in searches if s.shape == shape.name and s.mode == "plain"), None)
        if args.start and mode == "plain":
            start = args.start
        elif mode == "alst" and plain and plain.longest_ok():
            start = 2 * plain.longest_ok()  # ALST needs less memory than plain at every length
        else:
            # Dry: one trial per mode (a trial is ~10 s of start-up on 2 cores); the doubling and bisection
            # that follow a GPU start are tests/gpu/test_longseq_search.py's.
            start = args.cap if args.dry else max(4096, plan["predicted_max"] // 2)
        search = LengthSearch(shape.name, mode, start, args.grain, args.cap, args.steps,
                              reference=plain.trials if plain else [])
        searches.append(search)
        now = time.monotonic()
        deadline = now + (t0 + args.budget_s - now) / (len(order) - i)
        while (seq := search.next_length()) is not None:
            left = deadline - time.monotonic()
            if left < 5 or not search.fits_in(seq, left):
                if left < 5:
                    search.not_tried.append({"seq": seq, "predicted_wall_s": None, "seconds_left": round(left, 1)})
                    search.done = "time"
                break
            timeout = min(args.trial_timeout_s, left)
            record = run_trial(search, shape, plan, seq, args, limits, timeout, log_dir, timeout < args.trial_timeout_s)
            search.trials.append(record)
            print(f"[longseq] {_progress(shape.name, mode, record)}", flush=True)
        print(f"[longseq] {shape.name} {mode}: longest {search.longest_ok()} ({search.done})", flush=True)
    return searches


def _progress(shape: str, mode: str, r: dict) -> str:
    head = f"{shape} {mode} seq {r['seq']:,}: "
    if r["status"] == "ok":
        gpu = f", GPU peak {r['gpu_peak_bytes'] / GIB:.1f} GiB" if r.get("gpu_peak_bytes") else ""
        return (head + f"ok, step {r['median_step_s']:.2f} s, host peak {r['host_peak_bytes'] / GIB:.3g} GiB{gpu}, "
                f"{r['wall_s']:.0f} s")
    return head + f"FAILED ({r['reason']}): {str(r.get('detail', ''))[-200:]}, {r['wall_s']:.0f} s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    log_dir = args.out_dir / "longseq-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    facts = machine(args)
    limits = limits_for(args, facts)
    print(f"[longseq] {facts['device']}; host {facts['host_mem_total_bytes'] / GIB:.1f} GiB total, trial limit "
          f"{limits.host_limit_bytes / GIB:.2f} GiB; budget {args.budget_s:.0f} s", flush=True)
    from longseq_plan import plan

    gpu = limits.host_limit_bytes if args.dry else facts["gpu_total_bytes"]
    plans = {s.name: {m: plan(s, m, gpu, None if args.dry else limits.host_limit_bytes, args.dry)
                      for m in args.modes} for s in args.shapes}
    for name, by_mode in plans.items():
        for mode, p in by_mode.items():
            print(f"[longseq] {name} {mode}: the planner's longest {p['predicted_max']:,} with {p['rung']['name']}",
                  flush=True)
    searches = search_all(args, facts, limits, plans, log_dir, t0)
    elapsed = time.monotonic() - t0
    from longseq_report import write_outputs

    command = "python benchmarks/gpu/longseq.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    write_outputs(args, facts, limits, plans, searches, elapsed, ("GPU_CHECK_DRY=1 " if args.dry else "") + command)
    print(f"[longseq] wrote {args.out_dir / 'longseq.json'} and {args.out_dir / 'longseq.md'} in {elapsed:.0f} s",
          flush=True)
    return 1 if any(s.trials and not s.ok() and s.done != "time" for s in searches) else 0


if __name__ == "__main__":
    sys.exit(main())
