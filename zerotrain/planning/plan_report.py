"""Plain-text renderings of estimates and plans (stable text: docs/planning.md is generated from it)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import yaml

from zerotrain.planning.planner import Plan
from zerotrain.config.byte_sizes import format_bytes
from zerotrain.planning.rung_memory import GIB, Hardware, RungEstimate, Workload

# (column header, key in RungEstimate.gpu)
_GPU_COLUMNS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optim", "master + optimizer"),
    ("buckets", "gradient buckets"),
    ("gathered", "gathered units"),
    ("activ", "activations"),
    ("logits", "logits peak"),
)

# The ckpt column: none, selective, whole layers.
_CKPT_CELL = {False: "no", "selective": "sel", True: "yes"}


def describe_setup(source: str, total_params: int, hardware: Hardware, workload: Workload,
                   assumed: str | None = None) -> str:
    """The model, the hardware and the workload in two lines (three with the sizes assumed)."""
    gpus = hardware.gpus_per_node
    mem = f" x {format_bytes(hardware.gpu_memory)}" if hardware.gpu_memory else ""
    cpu = f", {format_bytes(hardware.cpu_memory)} CPU per node" if hardware.cpu_memory else ""
    switches = describe_switches(replace(workload, loss_chunk_tokens=None))  # the long-sequence ones, said as before
    return (
        f"{source}: {total_params:,} parameters\n" + (f"{assumed}\n" if assumed else "") +
        f"{hardware.nodes} node{'s' if hardware.nodes > 1 else ''} x {gpus} GPU{'s' if gpus > 1 else ''}{mem}{cpu}; "
        f"seq {workload.seq_len}, micro-batch {workload.micro_batch}, {workload.dtype}, {workload.attention} attention"
        + ("" if switches == "none" else f"; {switches}") + "\n"
    )


def describe_switches(work: Workload) -> str:
    """The long-sequence switches of `work` in words ("none" when all are off)."""
    ls = work.long_sequence
    parts = []
    if ls.sequence_parallel > 1:
        parts.append(f"sequence parallel {ls.sequence_parallel}")
    if ls.tiled_mlp:
        parts.append("tiled MLP" + ("" if ls.tiled_mlp is True else f" ({ls.tiled_mlp:,} tokens per tile)"))
    if ls.offload_activations:
        parts.append("activations offloaded")
    if work.loss_chunk_tokens:
        parts.append(f"chunked loss ({work.loss_chunk_tokens:,} tokens)")
    return ", ".join(parts) or "none"


def format_rung_table(rows: list[RungEstimate], hardware: Hardware, wide: bool = False) -> str:
    """One line per rung: where the optimizer and parameters live, checkpointing, the GPU total, CPU
    and NVMe per node, and the verdict; `wide` adds the GPU total's terms. Within 100 columns
    unless wide. GiB, or MiB when every figure is under 1 GiB; a figure that rounds to zero but
    is not shows as "<0.01"."""
    figures = [v for r in rows for v in (*r.gpu.values(), r.gpu_total, r.cpu_total, r.nvme_total)]
    unit, scale = ("GiB", GIB) if max(figures, default=0) >= GIB else ("MiB", 2**20)

    def cell(value: int, width: int) -> str:
        text = "<0.01" if 0 < value / scale < 0.005 else f"{value / scale:.2f}"
        return f"{text:>{width}}"

    terms = _GPU_COLUMNS if wide else ()
    head = f"{'stage':<6}{'optimizer':<10}{'params':<8}{'ckpt':<5}" + "".join(f"{h:>9}" for h, _ in terms)
    head += f"{'GPU':>9}{'CPU/node':>10}{'NVMe/node':>10}  fits"
    lines = [f"{unit} per GPU (CPU and NVMe per node)" + ("" if wide else "; --wide: the GPU total's terms"), head]
    for r in rows:
        rung = r.rung
        where = f"{rung.stage:<6}{_device(rung.offload_optimizer):<10}{_device(rung.offload_param):<8}"
        where += f"{_CKPT_CELL[rung.gradient_checkpointing]:<5}"
        cells = "".join(cell(r.gpu.get(key, 0), 9) for _, key in terms)
        verdict = "-" if hardware.gpu_memory is None and hardware.cpu_memory is None else ("yes" if r.fits else "no")
        lines.append(f"{where}{cells}{cell(r.gpu_total, 9)}{cell(r.cpu_total, 10)}{cell(r.nvme_total, 10)}  {verdict}")
    if hardware.gpu_memory is not None:
        lines.append(f"fits: GPU total + {format_bytes(hardware.gpu_reserve)} reserve (CUDA context, NCCL, "
                     f"fragmentation) <= {format_bytes(hardware.gpu_memory)}"
                     + (f"; CPU total + {format_bytes(hardware.cpu_reserve)} reserve (OS, CUDA context) <= "
                        f"{format_bytes(hardware.cpu_memory)} per node" if hardware.cpu_memory else ""))
    return "\n".join(lines) + "\n"


def _device(offload: str) -> str:
    return "gpu" if offload == "none" else offload


def format_plan(plan: Plan) -> str:
    """The recommendation in words, then why nothing faster, then the minimum GPU counts."""
    lines: list[str] = []
    hw = plan.hardware
    assert hw is not None
    c = plan.choice
    if c is None:
        lines.append("Nothing fits: even the last rung needs more memory than the hardware has.")
    else:
        lines.append(
            f"Recommended: {c.rung.name}, micro-batch {c.micro_batch} x {plan.accumulation} accumulation "
            f"step{'s' if plan.accumulation > 1 else ''} x {hw.world_size} GPU{'s' if hw.world_size > 1 else ''} "
            f"= global batch {plan.global_batch}."
        )
        if c.rung.gradient_checkpointing == "selective":
            lines.append("  Selective checkpointing: training.gradient_checkpointing: selective (zerotrain train); "
                         "elsewhere enable_gradient_checkpointing(model, \"selective\") from "
                         "zerotrain.runtime.activation_checkpointing.")
        elif c.rung.gradient_checkpointing:
            lines.append("  Gradient checkpointing: model.gradient_checkpointing_enable() (Hugging Face), "
                         "or training.gradient_checkpointing: true (zerotrain train).")
        lines.append(f"  per GPU {format_bytes(c.gpu_total)} + {format_bytes(c.gpu_reserve)} reserve"
                     + (f" of {format_bytes(hw.gpu_memory)}" if hw.gpu_memory else "")
                     + (f"; CPU {format_bytes(c.cpu_total)} per node" if c.cpu_total else "")
                     + (f"; NVMe {format_bytes(c.nvme_total)} per node" if c.nvme_total else ""))
    if plan.timings:
        lines.append(f"  Why: {plan.why()}.")
        lines.append(format_speed_table(plan))
    if plan.rejected:
        lines.append(("Rungs predicted faster that do not fit" if plan.timings else "Faster rungs that do not fit")
                     + " (at micro-batch 1):")
        for r in plan.rejected:
            lines.append(f"  {r.rung.name}: {'; '.join(r.overflow)}")
    lines.append(_min_gpus_line("without offload (any stage, with checkpointing)", plan.min_gpus_without_offload, hw))
    lines.append(_min_gpus_line("with CPU offload (with checkpointing)", plan.min_gpus_with_offload, hw))
    return "\n".join(lines) + "\n"


def format_speed_table(plan: Plan) -> str:
    """Every rung's predicted step beside its memory: micro-batch, step time, tokens/s per GPU, MFU,
    the exposed-communication share and whether it fits; the choice marked."""
    head = f"  {'rung':<52}{'mb':>4}{'step':>10}{'tok/s/GPU':>11}{'MFU':>6}{'comm':>6}{'GPU GiB':>9}  fits"
    lines = ["Predicted per rung (step time, tokens/s per GPU, MFU, exposed communication share):", head]
    for e, t in sorted(plan.timings, key=lambda et: et[1].step_s):
        mark = "*" if e is plan.choice else " "
        mfu = f"{t.mfu:.0%}" if t.mfu is not None else "-"
        lines.append(f"{mark} {e.rung.name:<52}{e.micro_batch:>4}{format_seconds(t.step_s):>10}{t.tokens_per_s_per_gpu:>11,.0f}"
                     f"{mfu:>6}{t.exposed_share:>6.0%}{e.gpu_total / GIB:>9.2f}  {'yes' if e.fits else 'no'}")
    chosen = plan.choice_time
    if chosen is not None:
        lines.append(f"  The choice is {chosen.bottleneck}.")
    if plan.rates is not None:
        lines.append("  Speeds: " + "; ".join(plan.rates.sources))
    return "\n".join(lines)


def format_seconds(seconds: float) -> str:
    """"12.3 s", "1.23 s", "45.6 ms", "0.016 ms": three significant figures, in s or ms."""
    if seconds >= 1:
        return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:,.0f} s"
    return f"{seconds * 1e3:.3g} ms"


def _min_gpus_line(what: str, count: int | None, hw: Hardware) -> str:
    if hw.gpu_memory is None:
        return f"Minimum GPUs {what}: give --gpu-memory to know"
    if count is None:
        return f"Minimum GPUs {what}: none up to 16384 (activations at micro-batch 1 do not fit one GPU)"
    return f"Minimum GPUs {what}: {count}"


def train_yaml_section(plan: Plan, ds_config: dict[str, Any]) -> str:
    """The `training:` and `zero:` sections of a `zerotrain train` YAML for the plan."""
    assert plan.choice is not None and plan.workload is not None
    training = {
        "micro_batch_size": plan.choice.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_checkpointing": plan.choice.rung.gradient_checkpointing,
        "precision": plan.workload.dtype,
    }
    zero = {"zero_optimization": ds_config["zero_optimization"]}
    return yaml.safe_dump({"training": training, "zero": zero}, sort_keys=False)


def plan_json(plan: Plan, ds_config: dict[str, Any] | None, curves: list | None = None,
              assumed: list[str] | None = None) -> str:
    """The plan as JSON; `assumed`: the lines saying what no flag gave (train YAML ranks, dtype, batch)."""
    hw = plan.hardware
    return json.dumps({
        "assumed": assumed or [],
        "hardware": {"gpus_per_node": hw.gpus_per_node, "nodes": hw.nodes, "world_size": hw.world_size,
                     "gpu_memory": hw.gpu_memory, "cpu_memory": hw.cpu_memory} if hw else None,
        "choice": plan.choice.as_dict() if plan.choice else None,
        "accumulation": plan.accumulation,
        "global_batch": plan.global_batch,
        "rejected": [r.as_dict() for r in plan.rejected],
        "min_gpus_without_offload": plan.min_gpus_without_offload,
        "min_gpus_with_offload": plan.min_gpus_with_offload,
        "deepspeed_config": ds_config,
        "verification": plan.verification,
        "predicted": plan.choice_time.as_dict() if plan.choice_time else None,
        "why": plan.why() if plan.timings else None,
        "rungs": [{**e.as_dict(), "predicted": t.as_dict()} for e, t in plan.timings],
        "speed_sources": list(plan.rates.sources) if plan.rates else None,
        "scale": [c.as_dict() for c in curves] if curves is not None else None,
    }, indent=2)
