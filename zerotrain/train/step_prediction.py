"""The run's predicted step time (RUN/predicted_step.json, written before the ranks start by the
command layer: cli/train_prediction.py) and the one line comparing the first timed steps with it.

A gap beyond 1.5x either way gets a sentence on where to look: communication or links slower
than assumed, or rates that understate the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from zerotrain.system.durable_files import atomic_write_text

PREDICTION_FILE = "predicted_step.json"
GAP = 1.5
"""Measured / predicted beyond this (or under its inverse) is worth a sentence."""


def write_prediction(run_dir: Path, prediction: dict) -> None:
    """RUN/predicted_step.json, atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / PREDICTION_FILE, json.dumps(prediction, indent=2) + "\n")


def read_prediction(run_dir: Path, world: int) -> dict | None:
    """The prediction made for this launch (None: none made, or made for another world size)."""
    try:
        data = json.loads((run_dir / PREDICTION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("world_size") == world and data.get("step_s") else None


def comparison(measured_s: float, prediction: dict) -> str:
    """"step time: measured 0.52 s, predicted 0.48 s (1.08x; the prediction is compute-bound ...)", and why."""
    predicted = float(prediction["step_s"])
    ratio = measured_s / predicted
    line = (f"step time: measured {measured_s:.3g} s, predicted {predicted:.3g} s ({ratio:.2f}x; the prediction "
            f"is {prediction.get('bottleneck', 'a step')})")
    if ratio > GAP:
        line += (f". Measured {ratio:.1f}x the prediction: communication exposed, or links slower than assumed? "
                 "Measure them: `zerotrain bench comm HOSTFILE --json F`, then logging.comm_probe: F")
    elif ratio < 1 / GAP:
        line += (". Faster than predicted: the assumed rates understate this machine; measure them: "
                 "`zerotrain bench compute --json F`, then logging.compute_probe: F")
    return line
