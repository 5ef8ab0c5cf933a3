"""The autotuner's files, in DeepSpeed's layout.

    autotuning_exps/<name>.json            each experiment: its DeepSpeed config and what it is
    autotuning_results/<name>/ds_config.json, metrics.json   each trial run: config, metrics or failure
    autotuning_results/<name>/stderr.log    the trial's warnings and error output (rank 0; others .rankN)
    autotuning_results/summary.txt          one line per experiment (median and spread), the verdict
    autotuning_results/ds_config_optimal.json   the winner's DeepSpeed config

A trial that ran holds one metrics dict per run (`runs`, repeats included) and their medians
(`metrics`). The winner has the best median: the highest throughput or FLOPS, or the lowest
latency (`metric: latency`; DeepSpeed's tuner ranks latency like the others and so picks the
slowest). Whether its lead is outside the noise is `noise.verdict`'s call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerotrain.autotuning.noise import Spread, Verdict, fmt, verdict
from zerotrain.system.durable_files import atomic_write_text


def samples_of(records: list[dict], metric: str) -> dict[str, list[float]]:
    """{trial name: the metric of each of its runs}, for the trials that ran, in trial order."""
    return {r["name"]: [run[metric] for run in r.get("runs") or [r["metrics"]]]
            for r in records if r["status"] == "ok"}


def check_result_dirs(results_dir: Path, exps_dir: Path, overwrite: bool) -> None:
    """FileExistsError before any trial when earlier results are there and may not be replaced."""
    for folder in (results_dir, exps_dir):
        if folder.exists() and any(folder.iterdir()) and not overwrite:
            raise FileExistsError(f"{folder} holds earlier results and autotuning.overwrite is false: "
                                  "move them away or set overwrite: true")


def write_results(results_dir: Path, exps_dir: Path, experiments: list[dict], records: list[dict],
                  pruned: list[dict], metric: str) -> Verdict:
    """Writes every file; returns the verdict (its winner None when no trial ran)."""
    for folder in (results_dir, exps_dir):
        folder.mkdir(parents=True, exist_ok=True)
    configs = {e["name"]: e for e in experiments}
    for exp in experiments:
        _write_json(exps_dir / f"{exp['name']}.json", {"name": exp["name"], "ds_config": exp["config"],
                                                        "predicted_gpu_bytes": exp["predicted_gpu_bytes"]})
    for record in records:
        if record["status"] == "not run":
            continue
        folder = results_dir / record["name"]
        _write_json(folder / "ds_config.json", configs[record["name"]]["config"])
        metrics = ({**record["metrics"], "runs": record.get("runs", [])} if record["status"] == "ok"
                   else {"status": record["status"], "reason": record.get("reason")})
        _write_json(folder / "metrics.json", metrics)
    samples = samples_of(records, metric)
    result = verdict(samples, metric)
    lines = [f"{'experiment':<36}{'status':<8}{metric + ' median':>20}  {'spread (min-max)':<26}note"]
    not_run = [r for r in records if r["status"] == "not run"]
    for record in records:
        if record["status"] == "not run":
            continue
        spread = Spread(record["name"], tuple(samples[record["name"]])) if record["name"] in samples else None
        median = fmt(spread.median) if spread else "-"
        if record["name"] == result.winner:
            note = "<- best"
        elif record["name"] in result.within_noise:
            note = "within noise of the best"
        else:
            note = record.get("reason", "")
        predicted = configs[record["name"]].get("predicted_step_s")
        if predicted and spread and record.get("metrics", {}).get("latency"):
            measured = record["metrics"]["latency"]
            note = f"{note}; step {measured:.3g} s measured, {predicted:.3g} s predicted ({measured / predicted:.2f}x)"
            note = note.lstrip("; ")
        if record.get("repeat_failed"):
            note = f"{note}; a repeat failed: {record['repeat_failed']}".lstrip("; ")
        lines.append(f"{record['name']:<36}{record['status']:<8}{median:>20}  "
                     f"{spread.text() if spread else '-':<26}{note}".rstrip())
    if not_run:
        lines.append(f"{len(not_run)} more not run ({not_run[0]['name']} ... {not_run[-1]['name']}): "
                     f"{not_run[0]['reason']}")
    for p in pruned:
        lines.append(f"{p['name']:<36}{'pruned':<8}{'-':>20}  {'-':<26}{p['reason']}")
    lines.append(result.text[:1].upper() + result.text[1:])
    (results_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    if result.winner is not None:
        _write_json(results_dir / "ds_config_optimal.json", configs[result.winner]["config"])
    return result


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
