"""What the step-time model expects of a bench job: tokens/s in all, for its config on its nodes.

A job that ran `zerotrain train` (a built-in workload, or `--module zerotrain train`) leaves its
run folder's config.yaml beside metrics.csv; with the job's hostfile (nodes x slots) and the
speeds (`--gpu`, `--compute`, `--comm`, as `zerotrain plan` takes them) that is a prediction.
`bench report --predict` sets each job's measured throughput beside it: a job far below its own
prediction is slow for a reason the model does not know (a bad node, a slow link), whatever the
size of the job, with no threshold picked by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.bench.run_dir import HOSTFILE, TRAIN_DIR

PREDICTION_FLOOR = 0.8
"""A job measuring under this fraction of its prediction fails: the model is within 20% of the
published runs it was checked against (docs/planning.md), so lower is not the model's error."""


def _config_of(job_dir: Path) -> Path | None:
    preferred = job_dir / TRAIN_DIR / "config.yaml"
    if preferred.is_file():
        return preferred
    found = sorted(p.parent / "config.yaml" for p in job_dir.rglob("metrics.csv") if (p.parent / "config.yaml").is_file())
    return found[0] if found else None


def predict_job(job_dir: Path, args: argparse.Namespace, metric: str = "tokens_per_s") -> tuple[float | None, str]:
    """(the whole job's predicted `metric`, tokens or samples per second, "") or (None, why there is none)."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.launcher.hostfile import parse_hostfile
    from zerotrain.planning.ladder import train_config_rung
    from zerotrain.planning.model_source import load_meta_model
    from zerotrain.planning.rung_memory import Hardware, Workload
    from zerotrain.planning.speed_args import rates_from_args
    from zerotrain.planning.step_time import predict_step
    from zerotrain.train.config_files import load_train_config

    config = _config_of(job_dir)
    if config is None:
        return None, "no zerotrain train config.yaml in the job folder"
    try:
        slots = parse_hostfile(job_dir / HOSTFILE)
        cfg = load_train_config(config)
        model = load_meta_model(str(config))
    except (OSError, ValueError, ConfigError) as error:
        return None, f"cannot predict: {error}"
    per_node = min(slots.values())
    t = cfg.training
    try:
        rung = train_config_rung(cfg)
        rates, _ = rates_from_args(args, per_node)
        if rates.device.peak_tflops is None:  # measured on a CPU: Gloo ranks
            from zerotrain.planning.hardware_rates import cpu_ranks

            rates = cpu_ranks(rates)
            if args.comm:
                from zerotrain.planning.hardware_rates import with_comm_probe

                rates = with_comm_probe(rates, args.comm)
        dtype = t.precision if t.precision in ("bf16", "fp16", "fp32") else ("bf16" if rates.device.peak_tflops else "fp32")
        workload = Workload.of_train_config(cfg, dtype)
        step = predict_step(model, rung, workload, Hardware(per_node, len(slots)), rates, t.gradient_accumulation_steps)
    except ValueError as error:
        return None, f"cannot predict: {error}"
    tokens = step.tokens_per_s_per_gpu * per_node * len(slots)
    return (tokens if metric == "tokens_per_s" else tokens / cfg.data.seq_len), ""
