"""`zerotrain bench report`: throughput from each job folder, verdicts, the CSV, the chart and the suspects.

The run folders in tests/fixtures/bench are written by hand in run_dir.py's layout:
`mixed` has one job per kind of log (zerotrain metrics.csv and progress lines, a
DeepSpeed script, an HF Trainer script, the bring-up guide's script) plus a timeout
and a crash; `pairs` has 2-node jobs where node c is slow only beside node d.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES
from zerotrain.bench.failure import failure_reason
from zerotrain.bench.report import JobResult, ReportError, report, suspect_nodes, write_csv
from zerotrain.bench.report_chart import THRESHOLD_GID, VERDICT_COLOURS, build_chart, save_chart
from zerotrain.bench.throughput import from_log_text

RUNS = FIXTURES / "bench"


@pytest.fixture
def runs(tmp_path) -> Path:
    """A copy of the fixture runs (report writes its CSV and PNG into RUN_DIR by default)."""
    return Path(shutil.copytree(RUNS, tmp_path / "runs"))


def _by_job(results: list[JobResult]) -> dict[str, JobResult]:
    return {r.job: r for r in results}


def test_each_kind_of_log_gives_its_throughput_and_verdict(runs):
    results = _by_job(report(runs / "mixed", threshold=100, metric="samples_per_s"))
    expected = {  # job: (throughput, verdict, where it came from)
        "batch-001": (125.0, "pass", "train/metrics.csv: mean of 2 logged steps after the first"),
        "batch-002": (142.5, "pass", "DeepSpeed RunningAvgSamplesPerSec (last)"),
        "batch-003": (110.4, "pass", "HF Trainer train_samples_per_second"),
        "batch-004": (72.7058, "fail", "`Throughput:` line"),
        "batch-005": (30.1, "timeout", "stopped at the timeout after 300 s"),
        "batch-006": (None, "crash", "exit 1: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970"),
        "batch-007": (102.5, "pass", "zerotrain train progress lines, mean of 2 after the first"),
    }
    assert sorted(results) == sorted(expected)
    for job, (value, verdict, reason) in expected.items():
        result = results[job]
        assert (result.throughput, result.verdict) == (pytest.approx(value) if value else None, verdict), job
        assert reason in result.reason, (job, result.reason)
    assert "is below the threshold 100" in results["batch-004"].reason
    assert results["batch-006"].reason.endswith("unhandled system error")


def test_metrics_csv_wins_over_the_progress_lines_of_the_same_job(runs):
    # batch-001's log has a progress line saying 999 samples/s; the CSV (125) is the record.
    assert _by_job(report(runs / "mixed", 100, "samples_per_s"))["batch-001"].throughput == pytest.approx(125.0)


def test_tokens_per_s_comes_from_zerotrain_and_says_which_jobs_give_samples_only(runs):
    results = _by_job(report(runs / "mixed", threshold=15000, metric="tokens_per_s"))
    assert results["batch-001"].throughput == pytest.approx(16000.0)
    assert results["batch-001"].verdict == "pass"
    assert results["batch-007"].throughput == pytest.approx(13120.0)
    assert results["batch-007"].verdict == "fail"
    assert results["batch-002"].verdict == "fail"
    assert "reports samples_per_s only: use --metric samples_per_s" in results["batch-002"].reason


@pytest.mark.parametrize(
    ("line", "metric", "value"),
    [
        ("ml-001: Throughput: 72.7058 samples/sec", "samples_per_s", 72.7058),
        ("  train_samples_per_second =     39.613", "samples_per_s", 39.613),
        ('{"train_tokens_per_second": 1234.5, "epoch": 1}', "tokens_per_s", 1234.5),
        ("[n 0]: step 5 | loss 1.0000 | lr 0.001 | grad norm 1 | 1,234,567 tok/s | 3.2 samples/s | mem -",
         "tokens_per_s", 1234567.0),
        ("epoch=0/micro_step=1/global_step=1, SamplesPerSec=12.5, MemAllocated=1GB", "samples_per_s", 12.5),
    ],
    ids=["guide-pdsh-prefix", "hf-log-metrics", "hf-json", "zerotrain-thousands", "deepspeed-plain"],
)
def test_log_line_formats(line, metric, value):
    found = from_log_text(line + "\n", metric)
    assert found is not None and found.value == pytest.approx(value)


def test_finished_job_without_any_throughput_fails_and_says_so(runs):
    job = runs / "mixed" / "batch-003"
    (job / "log.txt").write_text("[node3 0]: done\n")
    result = _by_job(report(runs / "mixed", 100, "samples_per_s"))["batch-003"]
    assert (result.verdict, result.throughput) == ("fail", None)
    assert result.reason.startswith("no throughput found: no metrics.csv, and no throughput line in log.txt")


def test_failure_reason_without_an_error_line_is_the_last_line_but_zerotrains_hints(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("$ python -m zerotrain launch error_job.py\n[n1 0]: loading\n"
                   "[n1 0]: zerotrain train: config x.yaml: not there\n\n  \n"
                   "wall time 5.5 s; every process of the job is stopped on all 1 nodes\n")
    assert failure_reason(log) == "zerotrain train: config x.yaml: not there"
    assert failure_reason(tmp_path / "absent.txt") == "no absent.txt to say why"


def test_failure_reason_is_the_first_traceback_of_chained_exceptions(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text(
        "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    f()\nKeyError: 'x'\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n  File \"a.py\", line 3, in <module>\n    g()\n"
        "    ~^^\nValueError: bad value\nsome later chatter\n"
    )
    assert failure_reason(log) == "KeyError: 'x'"  # the cause; what followed came of it


# What `zerotrain launch` wrote when ssh to the node was refused (pre-flight), and when a rank could not
# reach the master: the error, then zerotrain's summary and hints, which are not the cause.
PREFLIGHT_REFUSED = """\
$ python -m zerotrain launch --hostfile run/batch-001/hostfile --force_multi x.py
zerotrain launch: pre-flight checks
node        ssh      python  cwd  target  torch  zerotrain  GPUs  ulimit -n  ulimit -l  master port
───────────────────────────────────────────────────────────────────────────────────────────────────
127.0.0.59  refused  -       -    -       -      -          -     -          -          -
zerotrain launch: pre-flight failed, nothing was started:
  127.0.0.59: ssh connection refused; ssh to 127.0.0.59: connection refused on port 22: is sshd running there?
(--skip_preflight starts the job without these checks)
"""
RANK_REFUSED = """\
[gpu-1 0]: /venv/lib/python3.11/site-packages/torch/cuda/__init__.py:61: UserWarning: an Error in a warning
[gpu-1 0]: Traceback (most recent call last):
[gpu-1 0]:   File "/work/train.py", line 8, in <module>
[gpu-1 0]:     dist.init_process_group("gloo")
[gpu-1 0]: ConnectionRefusedError: [Errno 111] Connection refused
[gpu-2 1]: RuntimeError: Connection reset by peer
──────────────────────── zerotrain launch failed ────────────────────────
first failure: node gpu-1 (node rank 0), rank 0 (local rank 0) exited with code 1
To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
wall time 2.1 s; every process of the job is stopped on all 2 nodes; each rank's output is above
"""


@pytest.mark.parametrize(("text", "reason"), [
    (PREFLIGHT_REFUSED, "127.0.0.59: ssh connection refused; ssh to 127.0.0.59: connection refused on port 22: "
                        "is sshd running there?"),
    (RANK_REFUSED, "ConnectionRefusedError: [Errno 111] Connection refused"),
    ("[n 0]: ok\nssh: connect to host 10.0.0.5 port 22: Connection refused\nfirst failure: node n\n",
     "ssh: connect to host 10.0.0.5 port 22: Connection refused"),
    ("[n 0]: usage: zerotrain [-h] COMMAND ...\n[n 0]: zerotrain: error: unrecognized arguments: --local_rank=0\n"
     "(a hint)\n", "zerotrain: error: unrecognized arguments: --local_rank=0"),
], ids=["preflight-ssh-refused", "rank-traceback", "ssh-refused", "usage-error"])
def test_failure_reason_is_the_first_error_line_not_the_hints_after_it(tmp_path, text, reason):
    log = tmp_path / "log.txt"
    log.write_text(text)
    assert failure_reason(log) == reason


def test_unfinished_job_fails_but_its_nodes_are_not_suspects(runs):
    status_file = runs / "pairs" / "batch-002" / "status.json"
    status = json.loads(status_file.read_text())
    status_file.write_text(json.dumps({**status, "state": "running", "ended": None}))
    results = _by_job(report(runs / "pairs", 100, "samples_per_s"))
    assert results["batch-002"].verdict == "fail" and not results["batch-002"].finished
    assert "not finished (state running)" in results["batch-002"].reason
    assert suspect_nodes(list(results.values())) == ["e", "f"]


def test_nodes_only_in_jobs_that_did_not_pass_are_suspects(runs):
    results = report(runs / "pairs", threshold=100, metric="samples_per_s")
    assert [r.verdict for r in results] == ["pass", "fail", "timeout", "pass"]
    # d (slow batch) and e, f (timeout) never passed; c was slow beside d but passed beside a.
    assert suspect_nodes(results) == ["d", "e", "f"]


def test_csv_has_one_row_per_job_named_after_its_hostfile(runs, tmp_path):
    results = report(runs / "pairs", threshold=100, metric="samples_per_s")
    path = tmp_path / "out" / "results.csv"
    write_csv(results, path)
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["job", "nodes", "throughput", "metric", "verdict", "reason", "predicted"]
    assert [(r["job"], r["nodes"], r["throughput"], r["verdict"]) for r in rows] == [
        ("batch-001", "a b", "150.000", "pass"), ("batch-002", "c d", "61.500", "fail"),
        ("batch-003", "e f", "", "timeout"), ("batch-004", "a c", "149.200", "pass"),
    ]
    assert all(r["metric"] == "samples_per_s" for r in rows)


def test_chart_has_a_bar_per_job_coloured_by_verdict_and_the_threshold_line(runs, tmp_path):
    from matplotlib.colors import to_hex

    results = report(runs / "mixed", threshold=100, metric="samples_per_s")
    figure = build_chart(results, threshold=100, metric="samples_per_s")
    (axes,) = figure.axes
    thresholds = [line for line in axes.get_lines() if line.get_gid() == THRESHOLD_GID]
    assert len(thresholds) == 1 and list(thresholds[0].get_ydata()) == [100, 100]
    assert thresholds[0].get_label() == "threshold 100"
    bars = axes.patches
    assert [b.get_height() for b in bars] == pytest.approx([r.throughput or 0 for r in results])
    assert [to_hex(b.get_facecolor()) for b in bars] == [VERDICT_COLOURS[r.verdict] for r in results]
    assert axes.get_xlabel() and "samples/s" in axes.get_ylabel()
    png = save_chart(results, 100, "samples_per_s", tmp_path / "charts" / "results.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_or_empty_run_folder_and_negative_threshold_are_errors(tmp_path):
    with pytest.raises(ReportError, match="does not exist; give the --out folder"):
        report(tmp_path / "nope", 1, "samples_per_s")
    with pytest.raises(ReportError, match="holds no job folders"):
        report(tmp_path, 1, "samples_per_s")
    with pytest.raises(ReportError, match="cannot be negative"):
        report(tmp_path, -1, "samples_per_s")


def test_unreadable_status_json_is_an_error_naming_the_file(runs):
    (runs / "pairs" / "batch-002" / "status.json").write_text("{not json")
    with pytest.raises(ReportError, match=r"batch-002/status.json cannot be read"):
        report(runs / "pairs", 1, "samples_per_s")


# --- through the installed console script -------------------------------------------------


@pytest.mark.slow
def test_cli_writes_csv_and_png_prints_the_table_and_suspects_and_exits_1(runs, zerotrain_cli):
    proc = zerotrain_cli("bench", "report", runs / "pairs", "--threshold", "100",
                         "--csv", "results/pairs.csv", "--plot", "results/pairs.png", env={"COLUMNS": "200"})
    assert proc.returncode == 1, proc.stderr
    assert (zerotrain_cli.cwd / "results" / "pairs.png").read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader((zerotrain_cli.cwd / "results" / "pairs.csv").open()))
    assert [r["verdict"] for r in rows] == ["pass", "fail", "timeout", "pass"]
    assert "2 of 4 jobs passed" in proc.stdout
    assert "suspects: d e f" in proc.stdout
    assert "batch-002" in proc.stdout and "61.5" in proc.stdout


@pytest.mark.slow
def test_cli_exits_0_when_every_job_passed_and_2_for_a_missing_run_folder(runs, zerotrain_cli):
    for job in ("batch-002", "batch-003"):
        shutil.rmtree(runs / "pairs" / job)
    proc = zerotrain_cli("bench", "report", runs / "pairs", "--threshold", "100")
    assert proc.returncode == 0, proc.stderr
    assert (runs / "pairs" / "results.csv").is_file() and (runs / "pairs" / "results.png").is_file()
    assert "suspects: none" in proc.stdout
    proc = zerotrain_cli("bench", "report", "no-such-run", "--threshold", "100")
    assert proc.returncode == 2 and "run folder no-such-run does not exist" in proc.stderr


def _predicted_job(run: Path, name: str, nodes: list[str], tokens_per_s: float | None = None) -> Path:
    """A finished `zerotrain train` job folder: its hostfile, the run's config.yaml, a metrics.csv."""
    from zerotrain.bench.run_dir import JobStatus
    from zerotrain.train.config_files import load_train_config

    job = run / name
    JobStatus(name, nodes, "finished", 0, 10.0).write(job)
    (job / "hostfile").write_text("".join(f"{n} slots=2\n" for n in nodes))
    load_train_config(None).write(job / "train")  # the embedded default job: a small Llama
    if tokens_per_s is not None:
        rows = "".join(f"{s},{tokens_per_s}\n" for s in (10, 20, 30))
        (job / "train" / "metrics.csv").write_text("step,tokens_per_s\n" + rows)
    return job


def test_predict_fails_a_job_far_below_its_own_prediction_with_no_threshold_given(tmp_path):
    import argparse

    from zerotrain.bench.job_prediction import predict_job

    probe = tmp_path / "compute.json"
    probe.write_text(json.dumps({"kind": "zerotrain-bench-compute", "version": 1, "device_type": "cpu",
                                 "device": "cpu (test)", "matmul_tflops": 0.02, "cpu_adam_elements_per_s": 2e8}))
    speeds = argparse.Namespace(gpu=None, intra_node=None, inter_node=None, compute=str(probe), comm=None,
                                gpu_memory=None)
    run = tmp_path / "run"
    first = _predicted_job(run, "batch-001", ["node1", "node2"])
    predicted, why = predict_job(first, speeds)
    assert predicted and predicted > 0 and not why
    _predicted_job(run, "batch-001", ["node1", "node2"], tokens_per_s=0.95 * predicted)
    _predicted_job(run, "batch-002", ["node3", "node4"], tokens_per_s=0.5 * predicted)
    with pytest.raises(ReportError, match="--predict"):
        report(run, None, "tokens_per_s")
    results = _by_job(report(run, None, "tokens_per_s", speeds))
    assert results["batch-001"].verdict == "pass" and "0.95x the predicted" in results["batch-001"].reason
    assert results["batch-002"].verdict == "fail" and "0.50x the predicted" in results["batch-002"].reason
    assert results["batch-002"].predicted == pytest.approx(predicted)
    assert suspect_nodes(list(results.values())) == ["node3", "node4"]
    save_chart(list(results.values()), None, "tokens_per_s", tmp_path / "chart.png")  # no threshold line
