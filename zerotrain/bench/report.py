"""`zerotrain bench report`: each job's throughput and verdict, a CSV, a bar chart and the suspect nodes.

Verdicts, one per job folder of RUN_DIR (run_dir.py):

    timeout  the job was stopped at `bench run --timeout`
    crash    the job exited non-zero; the reason is the first error line of its log (failure.py)
    fail     it finished, but its throughput is below --threshold, or none was found; with
             --predict, below 0.8x what the step-time model predicts for its config on its nodes
    pass     it finished at --threshold (and its prediction's floor) or more

Suspects are the nodes that were only ever in jobs that did not pass: a node that
also ran in a passing job is healthy enough, so the fault lies with its batch-mates.
The exit status is 0 when every job passed and 1 when any did not (a finding, as
with `diff` or `grep`, so a bring-up script can stop there), 2 for a bad command line
or RUN_DIR. The CSV and the chart are written either way.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zerotrain.bench.failure import failure_reason
from zerotrain.bench.run_dir import LOG_FILE, STATUS_FILE, JobStatus, job_dirs
from zerotrain.bench.throughput import METRICS, UNITS, find_throughput, format_rate

VERDICTS = ("pass", "fail", "timeout", "crash")
VERDICT_STYLE = {"pass": "green", "fail": "yellow", "timeout": "magenta", "crash": "red"}
CSV_FIELDS = ["job", "nodes", "throughput", "metric", "verdict", "reason", "predicted"]
NOT_ALL_PASSED_EXIT_CODE = 1


class ReportError(ValueError):
    """A RUN_DIR or flag that `bench report` cannot use; the message says the fix."""


@dataclass(frozen=True)
class JobResult:
    """One row of the report."""

    job: str
    nodes: list[str]
    throughput: float | None
    metric: str
    verdict: str
    reason: str
    finished: bool = True
    """False while the job is pending or running: its verdict says nothing about its nodes yet."""
    predicted: float | None = None
    """With --predict: the step-time model's throughput for the job's config on its nodes."""


def judge_job(job_dir: Path, threshold: float | None, metric: str, predict=None) -> JobResult:
    """The verdict on one job folder; `predict`: the speed flags (argparse) to predict it with."""
    try:
        status = JobStatus.read(job_dir)
    except (OSError, ValueError, TypeError) as error:
        raise ReportError(f"{job_dir / STATUS_FILE} cannot be read ({error}); it should be the JSON that "
                          f"`zerotrain bench run` writes. Remove the folder or run the job again.") from None
    found, missing = find_throughput(job_dir, metric)
    value = found.value if found else None
    unit = UNITS[metric]

    predicted, no_prediction = (None, "")
    if predict is not None:
        from zerotrain.bench.job_prediction import predict_job

        predicted, no_prediction = predict_job(job_dir, predict, metric)

    def result(verdict: str, reason: str, finished: bool = True) -> JobResult:
        return JobResult(status.job, list(status.nodes), value, metric, verdict, reason, finished, predicted)

    if status.state == "timeout":
        ran = f" after {status.elapsed_s:.0f} s" if status.elapsed_s is not None else ""
        seen = f"; {format_rate(value)} {unit} by then ({found.source})" if found else ""
        return result("timeout", f"stopped at the timeout{ran}{seen}")
    if status.state == "failed":
        code = f"exit {status.exit_code}: " if status.exit_code is not None else ""
        return result("crash", code + failure_reason(job_dir / LOG_FILE))
    if status.state != "finished":
        return result("fail", f"not finished (state {status.state}): report again when `bench run` is done",
                      finished=False)
    if found is None:
        return result("fail", missing)
    measured = format_rate(found.value)
    if threshold is not None and found.value < threshold:
        return result("fail", f"{measured} {unit} is below the threshold {format_rate(threshold)} ({found.source})")
    if predict is not None:
        from zerotrain.bench.job_prediction import PREDICTION_FLOOR

        if predicted is None:
            return result("fail" if threshold is None else "pass", f"{measured} {unit}; {no_prediction}")
        ratio = found.value / predicted
        words = f"{measured} {unit} = {ratio:.2f}x the predicted {format_rate(predicted)} ({found.source})"
        return result("fail" if ratio < PREDICTION_FLOOR else "pass", words)
    return result("pass", f"{measured} {unit} >= {format_rate(threshold)} ({found.source})")


def suspect_nodes(results: list[JobResult]) -> list[str]:
    """Nodes of finished jobs that did not pass, never seen in a passing job; in the order they appear."""
    passed = {node for r in results if r.verdict == "pass" for node in r.nodes}
    suspects: dict[str, None] = {}
    for r in results:
        if r.finished and r.verdict != "pass":
            suspects.update((node, None) for node in r.nodes if node not in passed)
    return list(suspects)


def write_csv(results: list[JobResult], path: Path) -> None:
    """One row per job: job, nodes (space-separated), throughput (empty: none), metric, verdict, reason."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(CSV_FIELDS)
        for r in results:
            value = "" if r.throughput is None else f"{r.throughput:.3f}"
            predicted = "" if r.predicted is None else f"{r.predicted:.3f}"
            writer.writerow([r.job, " ".join(r.nodes), value, r.metric, r.verdict, r.reason, predicted])


def report(run_dir: Path, threshold: float | None, metric: str, predict=None) -> list[JobResult]:
    """The verdict on every job of `run_dir`, in job order."""
    if metric not in METRICS:
        raise ReportError(f"--metric {metric}: choose one of {', '.join(METRICS)}.")
    if threshold is None and predict is None:
        raise ReportError("say what a job must reach: --threshold X, or --predict (its step-time prediction)")
    if threshold is not None and threshold < 0:
        raise ReportError(f"--threshold {threshold:g}: a throughput threshold cannot be negative.")
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir} does not exist; give the --out folder of `zerotrain bench run`.")
    jobs = job_dirs(run_dir)
    if not jobs:
        raise ReportError(f"{run_dir} holds no job folders (none has a {STATUS_FILE}); give the --out folder "
                          f"of `zerotrain bench run`.")
    return [judge_job(job, threshold, metric, predict) for job in jobs]


def print_report(results: list[JobResult], threshold: float | None, metric: str, console: Console) -> None:
    """The results table, the pass count and the suspects line."""
    unit = UNITS[metric]
    against = [f"threshold {format_rate(threshold)}"] if threshold is not None else []
    predicting = any(r.predicted is not None for r in results)
    if predicting:
        against.append("predicted by the step-time model")
    table = Table(title=f"throughput per job ({unit}, {', '.join(against) or 'no threshold'})")
    columns = [("job", "left"), ("nodes", "left"), (unit, "right")]
    columns += [("predicted", "right")] if predicting else []
    for name, justify in (*columns, ("verdict", "left"), ("reason", "left")):
        table.add_column(name, justify=justify)
    for r in results:
        value = "-" if r.throughput is None else f"{r.throughput:,.1f}"
        predicted = ["-" if r.predicted is None else f"{r.predicted:,.1f}"] if predicting else []
        style = VERDICT_STYLE[r.verdict]
        table.add_row(escape(r.job), escape(" ".join(r.nodes)), value, *predicted, f"[{style}]{r.verdict}[/]",
                      escape(r.reason))
    console.print(table)
    passed = sum(r.verdict == "pass" for r in results)
    console.print(f"{passed} of {len(results)} jobs passed", highlight=False)
    unfinished = [r.job for r in results if not r.finished]
    if unfinished:
        console.print(f"[yellow]not finished, their nodes not judged: {escape(', '.join(unfinished))}[/]")
    suspects = suspect_nodes(results)
    if suspects:
        console.print(f"[bold red]suspects:[/] {escape(' '.join(suspects))} "
                      f"(only in jobs that did not pass)", highlight=False)
        if passed == 0 and len(results) > 1:
            console.print("[yellow]no job passed: the threshold, the job itself or shared storage or network may "
                          "be at fault rather than these nodes[/]")
    else:
        console.print("suspects: none", highlight=False)


def run_report(args: argparse.Namespace) -> int:
    """`zerotrain bench report`: 0 when every job passed, 1 when any did not, 2 on a bad input."""
    from zerotrain.bench.report_chart import save_chart
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error

    run_dir = Path(args.run_dir)
    csv_path = Path(args.csv) if args.csv else run_dir / "results.csv"
    plot_path = Path(args.plot) if args.plot else run_dir / "results.png"
    try:
        results = report(run_dir, args.threshold, args.metric, args if args.predict else None)
        write_csv(results, csv_path)
        save_chart(results, args.threshold, args.metric, plot_path)
    except (ReportError, OSError) as error:
        print_user_error("zerotrain bench report", error)
        return USAGE_EXIT_CODE
    console = Console(soft_wrap=True)  # long suspects lines stay whole for grep
    print_report(results, args.threshold, args.metric, console)
    console.print(f"wrote {escape(str(csv_path))} and {escape(str(plot_path))}", highlight=False)
    return 0 if all(r.verdict == "pass" for r in results) else NOT_ALL_PASSED_EXIT_CODE


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `report` to `zerotrain bench`."""
    parser = commands.add_parser(
        "report", help="throughput and pass/fail per job, a CSV, a bar chart and the suspect nodes",
        description="Read every job folder of RUN_DIR (the --out of `zerotrain bench run`): its throughput "
        "(zerotrain's metrics.csv, or `Throughput:`, DeepSpeed SamplesPerSec=, HF train_samples_per_second "
        "or zerotrain tok/s lines in its log) and its verdict: pass, fail, timeout or crash. "
        "Exit 0 when every job passed, 1 when any did not.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the folder `zerotrain bench run --out` wrote")
    parser.add_argument("--threshold", type=float, default=None, metavar="X",
                        help="the least throughput a job must reach to pass (in --metric units); "
                        "required unless --predict")
    parser.add_argument("--predict", action="store_true",
                        help="predict each zerotrain train job's throughput on its nodes (step-time model; "
                        "speeds from --gpu/--compute/--comm) and fail those under 0.8x their prediction")
    from zerotrain.planning.speed_args import add_speed_args

    add_speed_args(parser)
    parser.add_argument("--metric", choices=METRICS, default="samples_per_s",
                        help="what --threshold measures (default: samples_per_s)")
    parser.add_argument("--csv", metavar="FILE", help="where to write the CSV (default: RUN_DIR/results.csv)")
    parser.add_argument("--plot", metavar="FILE", help="where to write the PNG chart (default: RUN_DIR/results.png)")
    parser.set_defaults(handler=run_report)
