"""`--max-seq-len` for `zerotrain estimate` and `plan`: the longest sequence, what to switch on to go
longer, and the `zerotrain train` YAML that runs it (text and JSON from one computation)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import yaml
from torch import nn

from zerotrain.config.byte_sizes import format_bytes
from zerotrain.planning.longest_sequence import (GRAIN, LongestAnswer, longest_sequence, switches_to_go_longer,
                                                 train_yaml_keys)
from zerotrain.planning.plan_report import describe_switches
from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung


def longest_sequence_report(model: nn.Module, hardware: Hardware, workload: Workload, base: dict | None,
                            checkpointing: bool | None = None) -> dict[str, Any]:
    """{"text", "json", "ok"}: the longest sequence for `workload`'s switches on `hardware`, per rung,
    what each switch left off would reach, and the YAML that runs the answer. ok: something fits."""
    answer = longest_sequence(model, hardware, workload, base, checkpointing)
    longer = switches_to_go_longer(model, hardware, answer, base, checkpointing) if answer.best else []
    text = _text(model, hardware, answer, longer, base)
    data = {
        "max_seq_len": answer.seq_len,
        "switches": _switches_json(answer.workload),
        "rung": answer.best.estimate.as_dict() if answer.best else None,
        "per_rung": [{"rung": r.rung.name, "max_seq_len": r.seq_len} for r in answer.rungs],
        "to_go_longer": [{"set": label, "max_seq_len": a.seq_len, "rung": a.best.rung.name if a.best else None}
                         for label, a in longer],
        "train_yaml": train_yaml_keys(answer, base, hardware.nvme_path) if answer.best else None,
    }
    return {"text": text, "json": data, "ok": answer.best is not None}


def describe_hardware(source: str, total_params: int, hardware: Hardware, workload: Workload) -> str:
    """The model and the hardware, as `describe_setup` words them (the sequence is the answer here)."""
    from zerotrain.planning.plan_report import describe_setup

    first, *_, machines = describe_setup(source, total_params, hardware, workload).splitlines()
    return f"{first}\n{machines.split('; seq ')[0]}\n"


def _switches_json(work: Workload) -> dict[str, Any]:
    ls = work.long_sequence
    return {"sequence_parallel_size": ls.sequence_parallel, "tiled_mlp": ls.tiled_mlp,
            "offload_activations": ls.offload_activations, "loss_chunk_tokens": work.loss_chunk_tokens}


def _text(model: nn.Module, hardware: Hardware, answer: LongestAnswer, longer: list[tuple[str, LongestAnswer]],
          base: dict | None) -> str:
    work = answer.workload
    lines = [f"Long-sequence switches: {describe_switches(work)}; micro-batch 1, {work.dtype}, {work.attention} attention"]
    if answer.best is None:
        lines.append(f"Longest sequence: none fits, not even {GRAIN:,} tokens at micro-batch 1 on any rung "
                     "(the model states alone are over: see `zerotrain estimate` without --max-seq-len)")
        return "\n".join(lines) + "\n"
    est = answer.best.estimate
    lines.append(f"Longest sequence: {answer.seq_len:,} tokens per sample, with {answer.best.rung.name}")
    cpu = f"; CPU per node {format_bytes(est.cpu_total)}" if est.cpu_total else ""
    lines.append(f"  per GPU {format_bytes(est.gpu_total)} + {format_bytes(est.gpu_reserve)} reserve{cpu}")
    grain = math.lcm(GRAIN, work.long_sequence.sequence_parallel)
    over = estimate_rung(model, answer.best.rung, replace(work, seq_len=answer.seq_len + grain), hardware, base)
    if over.overflow:  # what the next length runs out of: the GPU, or the host holding offloaded activations
        lines.append(f"  at {answer.seq_len + grain:,} tokens: {over.overflow[0]}")
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit and answer.seq_len > limit:
        lines.append(f"  beyond the model's max_position_embeddings ({limit:,}): it needs rope scaling "
                     "(model.config_overrides) to train there")
    if longer:
        lines.append("To go longer (each alone, then together):")
        for label, other in longer:
            gain = f"{other.seq_len / answer.seq_len:.1f}x" if other.seq_len else "-"
            where = other.best.rung.name if other.best else "nothing fits"
            lines.append(f"  {label:<40}{other.seq_len:>12,} tokens {gain:>6}  ({where})")
    lines.append("Longest sequence per rung (micro-batch 1):")
    width = max(len(r.rung.name) for r in answer.rungs) + 2
    for r in answer.rungs:
        lines.append(f"  {r.rung.name:<{width}}{r.seq_len:>12,}" if r.seq_len else f"  {r.rung.name:<{width}}{'none':>12}")
    lines.append("")
    lines.append("zerotrain train YAML:")
    text = "\n".join(lines) + "\n"
    return text + yaml.safe_dump(train_yaml_keys(answer, base, hardware.nvme_path), sort_keys=False)

