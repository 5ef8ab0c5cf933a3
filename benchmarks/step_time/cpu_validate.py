"""How close the step-time model is on this CPU machine, calibrated only by `bench comm` and `bench compute`.

    .venv/bin/python benchmarks/step_time/cpu_validate.py [--models 5m,25m] [--ranks 2,4] [--rungs all]
        [--warmup 3] [--steps 12] [--out runs/step-time-cpu.md] [--json FILE] [--work DIR] [--table JSON]

Per ranks count R: `bench comm` on `localhost slots=R` (Gloo). Per model (cpu-5m.yaml, cpu-25m.yaml) and R:
`bench compute MODEL --threads 1` as R processes at once, each sharing the cores as a rank does (R > cores:
oversubscribed; other work on the machine takes its share too): a copy's rates are a rank's, their median
goes to the model (on an idle machine: the single-thread rate x min(1, cores / R)); the CPU Adam rate, which
step_time divides among a node's ranks, is the node's: per copy x R. Then `zerotrain train MODEL` on R ranks
(OMP_NUM_THREADS=1) per rung: stages 0-3 with and without gradient checkpointing, stage 2 + CPU optimizer
offload. metrics.csv's row per step gives its seconds (tokens_per_s; the logging's two small collectives
included); after --warmup steps the median is compared with `predict_step` on with_comm_probe(
with_compute_probe(named_rates('h100'), compute), comm) (no overlap on Gloo/CPU). Noise: a run's IQR, and
the first rung of each model and R run again at the end (run-to-run); the ordering check asks, for pairs of
rungs whose medians differ by more than that noise, whether the prediction orders them the same way.
"Other load": cores that other processes kept busy during a run (/proc/stat). --table JSON: the table again.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from zerotrain.planning.hardware_rates import named_rates, with_comm_probe, with_compute_probe
from zerotrain.planning.ladder import Rung
from zerotrain.planning.model_source import load_meta_model
from zerotrain.planning.rung_memory import Hardware, Workload
from zerotrain.planning.step_time import predict_step
from zerotrain.train.config_files import load_train_config

HERE = Path(__file__).resolve().parent
MODELS = {"5m": HERE / "cpu-5m.yaml", "25m": HERE / "cpu-25m.yaml"}
# name: (stage, offload_optimizer, gradient_checkpointing)
RUNGS = {"z0": (0, "none", False), "z1": (1, "none", False), "z2": (2, "none", False), "z3": (3, "none", False),
         "z0+ckpt": (0, "none", True), "z1+ckpt": (1, "none", True), "z2+ckpt": (2, "none", True),
         "z3+ckpt": (3, "none", True), "z2+cpu-opt": (2, "cpu", False)}
RATE_KEYS = ("matmul_tflops", "attention_tflops", "layer_tflops", "head_tflops", "device_adam_elements_per_s",
             "copy_gbps", "fresh_copy_gbps")
AGAIN = " (again)"


def default_cli(work: Path):
    """`cli(*args, env=..., timeout=...)`: the installed `zerotrain` console script, run from `work`."""
    script = str(Path(sys.executable).parent / "zerotrain")

    def cli(*args, env: dict | None = None, timeout: float = 600.0):
        return subprocess.run([script, *map(str, args)], cwd=work, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return cli


def any_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:  # tests pass tests/free_ports.py's instead
        return s.getsockname()[1]


def other_load(run):
    """(run()'s result, the cores other processes kept busy meanwhile, on average): /proc/stat's busy time
    of every core less the CPU time of run()'s own processes (0 where /proc/stat is not there)."""
    import resource

    def busy_and_mine() -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        mine = usage.ru_utime + usage.ru_stime
        if not Path("/proc/stat").is_file():
            return mine, mine
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), mine  # less idle and iowait

    began, (busy, mine) = time.perf_counter(), busy_and_mine()
    result = run()
    wall, (busy_after, mine_after) = time.perf_counter() - began, busy_and_mine()
    return result, max(0.0, (busy_after - busy) - (mine_after - mine)) / wall if wall else 0.0


def _check(proc, what: str):
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def comm_probe(cli, work: Path, ranks: int, max_size: str = "256M", iters: int = 5, port=any_port) -> Path:
    """`zerotrain bench comm` over R Gloo ranks on this machine, up to the models' whole gradient; its JSON."""
    hostfile, out = work / f"hosts-{ranks}", work / f"comm-{ranks}.json"
    hostfile.write_text(f"localhost slots={ranks}\n")
    _check(cli("bench", "comm", hostfile, "--max-size", max_size, "--no-pairs", "--iters", iters, "--warmup", "2",
               "--master_port", port(), "--json", out, timeout=600), f"bench comm ({ranks} ranks)")
    return out


def compute_probe(cli, work: Path, model: Path, ranks: int, iters: int = 10) -> Path:
    """R concurrent `zerotrain bench compute MODEL --threads 1` (module docstring); the merged JSON's path."""
    name = f"compute-{model.stem}-{ranks}"
    micro_batch = load_train_config(model).training.micro_batch_size
    outs = [work / f"{name}.copy{i}.json" for i in range(ranks)]
    with ThreadPoolExecutor(ranks) as pool:  # all at once, as the ranks run
        procs = list(pool.map(lambda out: cli("bench", "compute", model, "--device", "cpu", "--threads", "1",
                                              "--micro-batch", micro_batch, "--iters", iters, "--warmup", "3",
                                              "--json", out, timeout=600), outs))
    for i, proc in enumerate(procs):
        _check(proc, f"bench compute copy {i}")
    docs = [json.loads(p.read_text()) for p in outs]
    merged = dict(docs[0])
    for key in RATE_KEYS:
        if all(d.get(key) for d in docs):
            merged[key] = statistics.median(d[key] for d in docs)
    merged["cpu_adam_elements_per_s"] = statistics.median(d["cpu_adam_elements_per_s"] for d in docs) * ranks
    merged["copies"] = {"ranks": ranks, "per_copy": [{k: d.get(k) for k in RATE_KEYS} for d in docs]}
    out = work / f"{name}.json"
    out.write_text(json.dumps(merged, indent=2) + "\n")
    return out


def train_steps(cli, work: Path, model: Path, ranks: int, rung: str, warmup: int, steps: int, port=any_port,
                extra: tuple = ()) -> tuple[list[float], float]:
    """(seconds of each step after the warmup of a `zerotrain train` run of `rung`, the cores other
    processes kept busy meanwhile: the noise a shared machine adds)."""
    stage, offload, ckpt = RUNGS[rung]
    run = work / "runs" / f"{model.stem}-{ranks}-{rung}"
    args = [model, "--nproc_per_node", ranks, "--output.dir", run, "--overwrite", "--data.cache_dir", work / "cache",
            "--training.max_steps", warmup + steps, "--zero.zero_optimization.stage", stage,
            "--training.gradient_checkpointing", str(ckpt).lower(), "--master_port", port(), *extra]
    if offload != "none":
        args += ["--zero.zero_optimization.offload_optimizer", f"{{device: {offload}}}"]
    proc, load = other_load(lambda: cli("train", *args, timeout=900))
    _check(proc, f"train {run.name}")
    t = (cfg := load_train_config(model)).training
    tokens = t.micro_batch_size * t.gradient_accumulation_steps * ranks * cfg.data.seq_len
    head, *lines = (run / "metrics.csv").read_text().splitlines()
    rows = [dict(zip(head.split(","), line.split(","))) for line in lines]
    return [tokens / float(r["tokens_per_s"]) for r in rows if int(r["step"]) > warmup], load


def predict(model: Path, ranks: int, rung: str, compute: Path, comm: Path):
    """`predict_step` of `rung` for MODEL on R ranks of this machine, from the two probes."""
    stage, offload, ckpt = RUNGS[rung]
    cfg = load_train_config(model)
    rates = with_comm_probe(with_compute_probe(named_rates("h100"), compute), comm)
    workload = Workload(cfg.data.seq_len, cfg.training.micro_batch_size, "fp32")
    return predict_step(load_meta_model(model), Rung(stage, offload, "none", ckpt), workload, Hardware(ranks),
                        rates, cfg.training.gradient_accumulation_steps, cfg.zero_dict())


@dataclass
class Row:
    model: str
    ranks: int
    rung: str
    micro_batch: int
    accumulation: int
    steps_s: list[float]
    predicted: dict
    other_load: float = 0.0

    @property
    def measured_s(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def iqr_s(self) -> float:
        q = statistics.quantiles(self.steps_s, n=4, method="inclusive") if len(self.steps_s) > 1 else [0, 0, 0]
        return q[2] - q[0]

    @property
    def error(self) -> float:
        return self.predicted["step_s"] / self.measured_s - 1

    def as_dict(self) -> dict:
        return {**asdict(self), "measured_s": self.measured_s, "iqr_s": self.iqr_s, "error": self.error}


def run_to_run(rows: list[Row]) -> dict[tuple[str, int], float]:
    """Per model and ranks, how far a rung's second run landed from its first (seconds): the noise
    between runs, which on a shared machine exceeds the spread within one."""
    first = {(r.model, r.ranks, r.rung): r.measured_s for r in rows}
    return {(r.model, r.ranks): abs(r.measured_s - first[(r.model, r.ranks, r.rung[:-len(AGAIN)])])
            for r in rows if r.rung.endswith(AGAIN)}


def ordering(rows: list[Row]) -> tuple[int, int, list[str]]:
    """(agreeing, clearly different pairs, the disagreements in words) within each model and ranks: pairs
    whose medians differ by more than both runs' IQR and the group's run-to-run difference."""
    between = run_to_run(rows)
    rows = [r for r in rows if not r.rung.endswith(AGAIN)]
    agree, total, wrong = 0, 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            noise = max(a.iqr_s, b.iqr_s, between.get((a.model, a.ranks), 0.0))
            if (a.model, a.ranks) != (b.model, b.ranks) or abs(a.measured_s - b.measured_s) <= noise:
                continue
            total += 1
            if (a.measured_s < b.measured_s) == (a.predicted["step_s"] < b.predicted["step_s"]):
                agree += 1
            else:
                wrong.append(f"{a.model} x{a.ranks}: {a.rung} {a.measured_s:.3f} s vs {b.rung} {b.measured_s:.3f} s "
                             f"measured, predicted {a.predicted['step_s']:.3f} vs {b.predicted['step_s']:.3f}")
    return agree, total, wrong


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho of two equally long lists (no ties expected)."""
    rx, ry = ({i: r for r, i in enumerate(sorted(range(len(v)), key=v.__getitem__))} for v in (xs, ys))
    n = len(xs)
    return 1 - 6 * sum((rx[i] - ry[i]) ** 2 for i in range(n)) / (n * (n * n - 1)) if n > 1 else 1.0


def markdown(rows: list[Row], command: str, cores: int) -> str:
    agree, total, wrong = ordering(rows)
    errors = [abs(r.error) for r in rows]
    rho = spearman([r.measured_s for r in rows], [r.predicted["step_s"] for r in rows])
    lines = [f"Reproduce: `{command}`", "",
             f"{len(rows)} runs on {cores} cores; rates from `bench comm` and `bench compute` only (module docstring "
             "of benchmarks/step_time/cpu_validate.py).", "",
             "| model | ranks | rung | micro-batch | accumulation | measured median s (IQR) | predicted s "
             "(compute + comm + optimizer, offload and buffers) | error | other load (cores) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p = r.predicted
        lines.append(f"| {r.model} | {r.ranks} | {r.rung} | {r.micro_batch} | {r.accumulation} | "
                     f"{r.measured_s:.3f} ({r.iqr_s:.3f}) | {p['step_s']:.3f} ({p['compute_s']:.3f} + "
                     f"{p['exposed_comm_s']:.3f} + {p['optimizer_s'] + p['offload_s'] + p.get('buffers_s', 0):.3f}) | "
                     f"{r.error:+.1%} | {r.other_load:.2f} |")
    lines += ["", f"Error: median {statistics.median(errors):.1%}, worst {max(errors):.1%}; "
              f"{sum(e <= 0.15 for e in errors)}/{len(rows)} within 15%.",
              f"Ordering: {agree}/{total} pairs of rungs (same model and ranks) whose measured medians differ by more "
              f"than the noise (either run's IQR, the run-to-run difference) are ordered the same by the prediction; "
              f"Spearman rho over all runs {rho:.3f}."]
    lines += ["Run-to-run (a rung run twice): " + ", ".join(f"{m} x{n} {s:.3f} s" for (m, n), s in between.items())
              + "."] if (between := run_to_run(rows)) else []
    lines += [f"- disagrees: {w}" for w in wrong]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="5m,25m", help=f"of {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--ranks", default="2,4", help="Gloo ranks on this machine (default: %(default)s)")
    p.add_argument("--rungs", default="all", help=f"of {', '.join(RUNGS)}, or all")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped at the start (default: %(default)s)")
    p.add_argument("--steps", type=int, default=12, help="steps timed after them (default: %(default)s)")
    p.add_argument("--out", default="runs/step-time-cpu.md", help="the markdown table (default: %(default)s)")
    p.add_argument("--json", default=None, help="every run's figures (default: --out with .json)")
    p.add_argument("--work", default="runs/step-time-cpu-work", help="probes' JSON and run folders")
    p.add_argument("--table", default=None, metavar="JSON", help="only write the table again from this JSON")
    p.add_argument("--repredict", action="store_true", help="with --table: predict again from --work's probes")
    args = p.parse_args(argv)
    command = shlex.join([".venv/bin/python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])
    if args.table:
        done = json.loads(Path(args.table).read_text())
        rows = [Row(**{f.name: r[f.name] for f in fields(Row)}) for r in done["rows"]]
        for r in rows if args.repredict else ():  # the same runs against the model as it is now
            probes = (f"compute-{MODELS[r.model].stem}-{r.ranks}.json", f"comm-{r.ranks}.json")
            r.predicted = predict(MODELS[r.model], r.ranks, r.rung.removesuffix(AGAIN),
                                  *(Path(args.work) / name for name in probes)).as_dict()
        print(text := markdown(rows, done["command"] + f"`, predicted again by `{command}" * args.repredict,
                               done["cores"]))
        Path(args.out).write_text(text)
        return 0
    (work := Path(args.work).resolve()).mkdir(parents=True, exist_ok=True)
    cli, began = default_cli(work), time.perf_counter()
    rungs = list(RUNGS) if args.rungs == "all" else args.rungs.split(",")
    rows: list[Row] = []
    for ranks in map(int, args.ranks.split(",")):
        comm = comm_probe(cli, work, ranks)
        print(f"[{time.perf_counter() - began:6.0f} s] bench comm, {ranks} ranks: {comm}", flush=True)
        for name in args.models.split(","):
            compute = compute_probe(cli, work, model := MODELS[name], ranks)
            print(f"[{time.perf_counter() - began:6.0f} s] bench compute x{ranks}: {compute}", flush=True)
            t = load_train_config(model).training
            for rung in rungs + rungs[:1]:  # the first again at the end: the noise between runs
                again = AGAIN if any((r.model, r.ranks, r.rung) == (name, ranks, rung) for r in rows) else ""
                steps, load = train_steps(cli, work, model, ranks, rung, args.warmup, args.steps)
                row = Row(name, ranks, rung + again, t.micro_batch_size, t.gradient_accumulation_steps, steps,
                          predict(model, ranks, rung, compute, comm).as_dict(), load)
                rows.append(row)
                print(f"[{time.perf_counter() - began:6.0f} s] {name} x{ranks} {row.rung}: measured "
                      f"{row.measured_s:.3f} s (IQR {row.iqr_s:.3f}), predicted {row.predicted['step_s']:.3f} s "
                      f"({row.error:+.1%}), other load {load:.2f} cores", flush=True)
    print(text := markdown(rows, command, os.cpu_count() or 1))
    (out := Path(args.out)).parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    Path(args.json or out.with_suffix(".json")).write_text(json.dumps(
        {"command": command, "cores": os.cpu_count(), "rows": [r.as_dict() for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
