"""The step-time model's prediction for a `zerotrain train` run, made before any rank starts.

`train` may not import `planning` (planning reads train configs), so the command layer hands
this function to `main_train`, which writes what it returns to RUN/predicted_step.json; the
trainer compares its first timed steps with it (train/step_prediction.py). Speeds: a known GPU's
named defaults, or the files `logging.compute_probe` / `logging.comm_probe` name; with neither
(a CPU with no probe) there is no prediction and nothing is said.
"""

from __future__ import annotations

from typing import Any

import torch

_KNOWN_GPUS = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100"), ("A100-SXM4-40GB", "a100-40gb"),
               ("A100", "a100-80gb"), ("V100", "v100"), ("L40S", "l40s"))


def predict_train_step(cfg, world: int, per_node: int) -> dict[str, Any] | None:
    """The predicted step of `cfg` on `world` ranks (`per_node` per node), as JSON-ready data, or None.

    Raises ValueError for a probe file that cannot be read (before any rank starts).
    """
    from zerotrain.planning.hardware_rates import cpu_ranks, named_rates, with_comm_probe, with_compute_probe
    from zerotrain.planning.ladder import train_config_rung
    from zerotrain.planning.model_source import load_meta_model
    from zerotrain.planning.rung_memory import Hardware, Workload
    from zerotrain.planning.step_time import predict_step
    from zerotrain.train.zero_fill import resolve_precision

    probes = cfg.logging
    gpu = None
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        gpu = next((key for text, key in _KNOWN_GPUS if text in name), None)
    if gpu is None and not probes.compute_probe:
        return None
    rates = named_rates(gpu or "h100")
    if probes.compute_probe:
        rates = with_compute_probe(rates, probes.compute_probe)
    if gpu is None:
        rates = cpu_ranks(rates)
    if probes.comm_probe:
        rates = with_comm_probe(rates, probes.comm_probe)
    if world > per_node and rates.inter is None:  # across nodes, with no link named: the usual one, said
        from zerotrain.planning.hardware_rates import with_inter_node
        from zerotrain.planning.speed_args import USUAL_INTER

        # CPU machines: a plain Ethernet NIC
        rates = with_inter_node(rates, USUAL_INTER[gpu] if gpu else "25gbe", per_node, assumed=True)
    t = cfg.training
    rung = train_config_rung(cfg)
    # The precision the trainer itself resolves (the one rule, shared with estimate/plan of a YAML).
    dtype = resolve_precision(t.precision, "cuda" if torch.cuda.is_available() else "cpu", cfg.zero_dict())
    workload = Workload.of_train_config(cfg, dtype)
    step = predict_step(load_meta_model(cfg.model), rung, workload,
                        Hardware(per_node, max(1, world // per_node)), rates, t.gradient_accumulation_steps)
    return {"step_s": step.step_s, "bottleneck": step.bottleneck, "world_size": world, "rung": rung.name,
            "speeds": list(rates.sources), "predicted": step.as_dict()}
