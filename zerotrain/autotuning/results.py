"""The autotuner's files, in DeepSpeed's layout.

    autotuning_exps/<name>.json            each experiment: its DeepSpeed config and what it is
    autotuning_results/<name>/ds_config.json, metrics.json   each trial run: config, metrics or failure
    autotuning_results/summary.txt          one line per experiment, the best marked
    autotuning_results/ds_config_optimal.json   the winner's DeepSpeed config

The winner maximizes throughput or FLOPS, or minimizes latency (`metric: latency`; DeepSpeed's
tuner ranks latency like the others and so picks the slowest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def best_record(records: list[dict], metric: str) -> dict | None:
    """The trial with the best `metric` among those that ran."""
    ran = [r for r in records if r["status"] == "ok"]
    if not ran:
        return None
    pick = min if metric == "latency" else max
    return pick(ran, key=lambda r: r["metrics"][metric])


def write_results(results_dir: Path, exps_dir: Path, experiments: list[dict], records: list[dict],
                  pruned: list[dict], metric: str, overwrite: bool = True) -> dict | None:
    """Writes every file; returns the best record (None when no trial ran)."""
    for folder in (results_dir, exps_dir):
        if folder.exists() and any(folder.iterdir()) and not overwrite:
            raise FileExistsError(f"{folder} holds earlier results and autotuning.overwrite is false")
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
        _write_json(folder / "metrics.json", record.get("metrics") or {"status": record["status"],
                                                                      "reason": record.get("reason")})
    best = best_record(records, metric)
    lines = [f"{'experiment':<40}{'status':<10}{metric:>16}  note"]
    not_run = [r for r in records if r["status"] == "not run"]
    for record in records:
        if record["status"] == "not run":
            continue
        value = record.get("metrics", {}).get(metric) if record["status"] == "ok" else None
        note = "<- best" if record is best else record.get("reason", "")
        lines.append(f"{record['name']:<40}{record['status']:<10}{_fmt(value):>16}  {note}")
    if not_run:
        lines.append(f"{len(not_run)} more not run ({not_run[0]['name']} ... {not_run[-1]['name']}): "
                     f"{not_run[0]['reason']}")
    for p in pruned:
        lines.append(f"{p['name']:<40}{'pruned':<10}{'-':>16}  {p['reason']}")
    (results_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    if best is not None:
        _write_json(results_dir / "ds_config_optimal.json", configs[best["name"]]["config"])
    return best


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
