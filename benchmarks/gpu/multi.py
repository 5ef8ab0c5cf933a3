#!/usr/bin/env python
"""The GPU check's **multi** part: every GPU of this machine as one world (NCCL).

    python benchmarks/gpu/multi.py --out-dir DIR            # on the GPU machine (run.sh multi)
    python benchmarks/gpu/multi.py --out-dir DIR --dry      # 2 Gloo ranks on the CPU, tiny sizes

1. Parity and memory (fp32, a small Llama): zerotrain stages 0-3 at world W against plain torch and
   zerotrain at world 1 on the same global batch, step by step; each rank's parameters, gradients and
   optimizer state against world 1's (multi_checks.py says what must shrink, and the tolerances).
2. `zerotrain bench comm` on this node (one rank per GPU).
3. The speed table at world W (speed.py --world: zerotrain, DeepSpeed and FSDP2, eager and compiled,
   with exposed communication from a profiled step).

On a one-GPU machine, W is 2 on that GPU: two processes over NCCL if it accepts two ranks on one
device (it normally refuses: "Duplicate GPU detected"), else over Gloo. Step 1 then checks the
sharded CUDA paths; steps 2 and 3 run on the one GPU alone (2: world 1) or not at all (3: two ranks
time-sharing a GPU measure nothing of a multi-GPU step). Writes multi.json and multi.md; each run's
own files go to multi-logs/. Exit status: 0 when every check passed, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAGES = (0, 1, 2, 3)
# Parity's model: small enough for fp32 at world 1 in seconds, with every layer kind of the real one.
PARITY_SIZES = {"gpu": ["--vocab", "4096", "--hidden", "256", "--intermediate", "688", "--layers", "4",
                        "--heads", "8", "--kv-heads", "4", "--seq", "256"],
                "dry": []}  # speed.py --dry's own tiny sizes
SPEED_COLUMNS = {"gpu": "zerotrain-0,zerotrain-1,zerotrain-2,zerotrain-3,deepspeed-2,deepspeed-3,fsdp2,"
                        "zerotrain-3-compile,fsdp2-compile,deepspeed-3-compile",
                 "dry": "zerotrain-3"}  # the path once: parity's runs at world 2 cover the rest


def say(message: str) -> None:
    print(f"[multi] {message}", flush=True)


def plan_world(dry: bool) -> tuple[int, str | None, str, int]:
    """(world, backend for speed.py --backend or None, why, GPUs) for this machine."""
    if dry:
        return 2, None, "dry run: 2 Gloo ranks on the CPU", 0
    import torch

    gpus = torch.cuda.device_count()
    if gpus >= 2:
        return gpus, None, f"every GPU of this machine: {gpus} ranks over NCCL", gpus
    ok, why = _nccl_takes_two_ranks_on_one_gpu()
    if ok:
        return 2, "nccl", "one GPU: 2 ranks on it over NCCL", gpus
    return 2, "gloo", f"one GPU: 2 ranks on it over Gloo (NCCL refused two ranks on one device: {why})", gpus


def _nccl_takes_two_ranks_on_one_gpu() -> tuple[bool, str]:
    """Two processes on cuda:0 all-reduce over NCCL, within 90 s: (worked, the refusal's last line)."""
    code = ("import torch, torch.distributed as d\ntorch.cuda.set_device(0)\nd.init_process_group('nccl')\n"
            "t = torch.ones(1, device='cuda')\nd.all_reduce(t)\ntorch.cuda.synchronize()\n"
            "assert t.item() == 2\nd.destroy_process_group()\n")
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), script.name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return False, "no answer within 90 s"
    finally:
        os.unlink(script.name)
    last = [ln.strip() for ln in (done.stdout + done.stderr).splitlines()
            if "Error:" in ln and "ChildFailed" not in ln]  # the rank's own exception, not torchrun's summary
    return done.returncode == 0, (last[-1][-200:] if last else f"exit {done.returncode}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_speed(name: str, logs: Path, dry: bool, argv: list[str], timeout: float) -> dict | None:
    """speed.py with `argv` into logs/name/; its speed.json (None if it wrote none)."""
    out = logs / name
    cmd = [sys.executable, str(HERE / "speed.py"), "--out-dir", str(out), *(["--dry"] if dry else []), *argv]
    say(f"{name}: {' '.join(cmd[1:])}")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "console.log", "w") as fh:
        try:
            code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    report = out / "speed.json"
    say(f"{name}: exit {code}")
    return json.loads(report.read_text()) if report.is_file() else None


def parity(logs: Path, dry: bool, world: int, backend: str | None, device: str, timeout: float) -> dict:
    """Stages 0-3 at `world` against world 1 (fp32): per-stage loss and memory verdicts."""
    from multi_checks import LOSS_RTOL, loss_verdict, memory_verdict

    kind = "dry" if dry else "gpu"
    per_rank = 2
    common = ["--dtype", "fp32", "--checkpointing-modes", "off", "--warmup", "1", "--steps", "3",
              "--engines-per-process", "5", "--persistence-threshold", "0", *PARITY_SIZES[kind]]
    zt = ",".join(f"zerotrain-{s}" for s in STAGES)
    one = run_speed("parity-world1", logs, dry, [*common, "--engines", "plain," + zt,
                                                 "--micro-batch", str(per_rank * world)], timeout)
    many = run_speed(f"parity-world{world}", logs, dry, [*common, "--engines", zt, "--micro-batch", str(per_rank),
                                                         "--world", str(world),
                                                         *(["--backend", backend] if backend else [])], timeout)

    def row(rep, column):
        r = (rep or {}).get("results", {}).get(column, {}).get("off", {})
        return r if r.get("ok") else None

    rtol = LOSS_RTOL[device]
    losses, memory = [], []
    for s in STAGES:
        mine, plain, alone = row(many, f"zerotrain-{s}"), row(one, "plain"), row(one, f"zerotrain-{s}")
        losses.append(loss_verdict(s, mine and mine["losses"], {"plain torch, world 1": plain and plain["losses"],
                                                                 f"zerotrain-{s}, world 1": alone and alone["losses"]},
                                   rtol))
        memory.append(memory_verdict(s, world, alone and alone["engine_breakdown_bytes"],
                                     mine and mine["engine_breakdown_by_rank"]))
    return {"rtol": rtol, "micro_batch_per_rank": per_rank, "losses": losses, "memory": memory,
            "ok": all(v["ok"] for v in losses + memory)}


def bench_comm(logs: Path, slots: int, dry: bool, timeout: float) -> dict:
    """`zerotrain bench comm` on a one-node hostfile of `slots` ranks; its JSON."""
    hostfile, out = logs / "one-node", logs / "comm.json"
    hostfile.write_text(f"localhost slots={slots}\n")
    exe = Path(sys.executable).with_name("zerotrain")
    cmd = [str(exe) if exe.exists() else "zerotrain", "bench", "comm", str(hostfile),
           "--master_port", str(_free_port()), "--json", str(out), "--timeout", str(int(timeout))]
    if dry:
        cmd += ["--max-size", "64K", "--warmup", "1", "--iters", "3"]
    say(f"bench comm: {' '.join(cmd[1:])}")
    with open(logs / "comm.log", "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=logs, timeout=timeout + 60).returncode
    result = json.loads(out.read_text()) if out.is_file() else None
    return {"exit": code, "ranks": slots, "result": result, "ok": code == 0 and result is not None}


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"### GPU check: multi{' (dry run)' if m['dry'] else ''} on {m['device']}", "",
             f"Command: `{m['command']}` ({m['date']}, {m['wall_s']:.0f} s). World {m['world']}: {m['why']}.", ""]
    p = report["parity"]
    lines += [f"**Parity** (fp32, {p['micro_batch_per_rank']} sequences per rank, the same global batch at world 1; "
              f"relative tolerance {p['rtol']:.0e}, see multi_checks.py):", "",
              "| stage | max rel. diff per reference | losses | each rank's sharded state / world 1's | memory |",
              "|---|---|---|---|---|"]
    for lv, mv in zip(p["losses"], p["memory"]):
        diffs = ", ".join(f"{k} {v:.1e}" if v is not None else f"{k} -" for k, v in lv["against"].items())
        shares = ", ".join(f"{r['sharded']:.3f}" if r.get("sharded") is not None else "- (nothing sharded)"
                           for r in mv["ranks"])
        lines.append(f"| {lv['stage']} | {diffs or '-'} | {'ok' if lv['ok'] else 'FAILED: ' + lv['why']} | "
                     f"{shares or '-'} | {'ok' if mv['ok'] else 'FAILED: ' + mv['why']} |")
    c = report["comm"]
    lines += ["", f"**bench comm** ({c['ranks']} ranks): {'ok' if c['ok'] else 'FAILED, exit ' + str(c['exit'])}"
              " (rows in multi.json; the log in multi-logs/comm.log)", ""]
    speed = report.get("speed_md")
    lines += [speed if speed else f"**Speed at world {m['world']}**: {report.get('speed_skipped', 'did not run')}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "runs/gpu", help="where multi.json/.md go")
    p.add_argument("--dry", action="store_true", default=os.environ.get("GPU_CHECK_DRY") == "1",
                   help="2 Gloo ranks on the CPU, tiny sizes (default from GPU_CHECK_DRY=1)")
    p.add_argument("--speed-budget-s", type=float, default=None, help="speed.py --budget-s (default 300; dry 200)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per step of the part (default 420; dry 240)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out_dir).resolve()
    logs = out / "multi-logs"
    logs.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (240 if args.dry else 420)
    if not args.dry:
        import torch

        if not torch.cuda.is_available():
            print("multi.py: no CUDA device visible (use --dry for the CPU rehearsal)", file=sys.stderr)
            return 2
    world, backend, why, gpus = plan_world(args.dry)
    device = "cpu" if args.dry else "cuda"
    say(f"world {world}: {why}")
    report: dict = {"parity": parity(logs, args.dry, world, backend, device, timeout)}
    report["comm"] = bench_comm(logs, 2 if args.dry else max(1, gpus), args.dry, timeout)
    if args.dry or gpus >= 2:
        budget = args.speed_budget_s or (200 if args.dry else 300)
        speed = run_speed(f"speed-world{world}", logs, args.dry,
                          ["--world", str(world), "--engines", SPEED_COLUMNS["dry" if args.dry else "gpu"],
                           "--checkpointing-modes", "off", "--budget-s", str(budget)], timeout + budget)
        report["speed"] = speed
        speed_md = logs / f"speed-world{world}" / "speed.md"
        report["speed_md"] = speed_md.read_text() if speed_md.is_file() else None
        speed_ok = bool(speed and speed.get("zerotrain_ok"))
    else:
        report["speed_skipped"] = ("not run: two ranks time-sharing one GPU measure nothing of a multi-GPU step "
                                   "(`run.sh speed` measures this GPU alone)")
        speed_ok = True
    report["meta"] = {"dry": args.dry, "device": _device_name(args.dry), "world": world, "backend": backend,
                      "why": why, "gpus": gpus, "wall_s": time.perf_counter() - started,
                      "command": "python " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
                      "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    report["ok"] = report["parity"]["ok"] and report["comm"]["ok"] and speed_ok
    (out / "multi.json").write_text(json.dumps(report, indent=1))
    (out / "multi.md").write_text(markdown(report))
    print(markdown(report))
    say(f"{'every check passed' if report['ok'] else 'a check FAILED'}: {out / 'multi.md'}")
    return 0 if report["ok"] else 1


def _device_name(dry: bool) -> str:
    if dry:
        return "CPU (dry run: Gloo, no CUDA)"
    import torch

    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


if __name__ == "__main__":
    sys.exit(main())
