"""The config wizard's questions: `accelerate config`'s, each answered with the estimate behind it.

Questions are asked in `accelerate config`'s order by a `Wizard` (`wizard_questions`: flags,
then standard input, then defaults; a wrong typed answer is asked again with the answers it
accepts). Defaults come from `make_plan`: of the configurations that fit, the one the step-time
model predicts fastest (the GPU's speed from --gpu, else from its memory, as `zerotrain plan` takes
it). The GPUs default to this machine's (torch.cuda); without a GPU the memory of one has no
default. Each memory choice is shown as a table with a line per term of `estimate_rung`, and
what each term is. Then the run: learning rate, steps and run directory, so the files written are complete.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch import nn

from zerotrain.planning.ladder import Rung
from zerotrain.planning.planner import make_plan
from zerotrain.config.byte_sizes import format_bytes
from zerotrain.planning.rung_memory import Hardware, RungEstimate, Workload, estimate_rung, rung_config
from zerotrain.planning.speed_args import rates_from_args
from zerotrain.planning.wizard_questions import (  # noqa: F401 - Wizard, WizardError, Answers are this module's API
    CHECKPOINTING, CPU_MEMORY, FOLDER, GPU_MEMORY, LEARNING_RATE, NON_NEGATIVE, REQUIRED, YES_NO, Answers, Wizard, WizardError,
    choice, divisor_of, multiple_of, positive_int,
)

DEFAULT_LR = 3e-4
"""The learning rate offered: zerotrain train's own default (training.lr)."""
DEFAULT_MAX_STEPS = 1000
SPEED_KEYS = ("gpu", "intra_node", "inter_node", "compute", "comm")
"""`zerotrain plan`'s speed flags (speed_args.py), which `zerotrain init` takes too."""

# What each line of a memory table is, in the order estimate_rung reports them. `{...}` are
# filled from the job: data-parallel size, dtype, bucket and live-parameter limits.
TERM_MEANINGS = {
    "parameters": "the {dtype} weights; stage 3 keeps a 1/{n} shard of each layer (small ones whole), "
                  "parameter offload moves that shard to the CPU",
    "gradients": "stages 0-1: the whole {dtype} gradient, kept between steps; stages 2-3: only this GPU's "
                 "1/{n} shard (on the CPU with optimizer offload)",
    "master + optimizer": "fp32 master weights and the optimizer's state (AdamW: two moments); stages 1-3 keep "
                          "a 1/{n} shard, optimizer offload moves it to the CPU",
    "gradient buckets": "stages 2-3: whole-gradient buckets filled in backward and freed once reduce-scattered "
                        "into the shard, up to 3 alive of reduce_bucket_size = {bucket:,} elements ({bucket_bytes} "
                        "each); stages 0-1 reduce inside the whole gradient instead",
    "gathered units": "stage 3: whole parameters gathered for compute, the root module's for the whole step and "
                      "layers up to stage3_max_live_parameters = {live:,} elements",
    "activations": "what autograd saves in forward for backward, at micro-batch {micro} (gradient checkpointing "
                   "keeps each layer's input only)",
    "logits peak": "the LM head's logits and their gradient, at the loss",
    "total": "the sum, each term at its largest; the buckets fill while backward frees activations, so the "
             "step's real peak can be lower",
}


def run_questions(w: Wizard, model: nn.Module, source: str) -> Answers:
    """Every question in `accelerate config`'s order (after the machines, the model's workload)."""
    a = w.answers
    gpus = w.gpus
    w.ask("num_machines", "How many machines?", positive_int("1, or 2 for two machines"), 1)
    w.ask("gpus_per_machine", "How many GPUs per machine?", positive_int("8"), gpus.count or 1)
    here = (f"  this machine's GPU: {gpus.name}, {format_bytes(gpus.memory)}" if gpus.memory else
            "  no GPU on this machine: give the memory of one GPU of the machines you will train on")
    w.ask("gpu_memory", "Memory of one GPU", GPU_MEMORY, gpus.memory or REQUIRED, hint=here)
    w.ask("cpu_memory", "CPU memory of one machine (0: do not check)", CPU_MEMORY, None)
    world = a["num_machines"] * a["gpus_per_machine"]
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 2048)
    w.ask("seq_len", "Sequence length (tokens per sample)", positive_int("2048"), min(2048, limit))
    w.ask("global_batch", "Global batch (samples per optimizer step, all GPUs)", multiple_of(world), 8 * world)
    w.ask("mixed_precision", "Mixed precision (no/fp16/bf16)", choice("no", "fp16", "bf16", aliases={"fp32": "no"}),
          "bf16")
    hardware = Hardware(a["gpus_per_machine"], a["num_machines"], a["gpu_memory"], a["cpu_memory"],
                        w.flags.get("nvme"))
    dtype = "fp32" if a["mixed_precision"] == "no" else a["mixed_precision"]
    attention = w.flags.get("attention") or "sdpa"
    speed = SimpleNamespace(gpu_memory=a["gpu_memory"], **(w.flags.get("speed") or dict.fromkeys(SPEED_KEYS)))
    rates, _ = rates_from_args(speed, a["gpus_per_machine"])  # ValueError on a bad probe file
    a.plan = make_plan(model, hardware, a["seq_len"], a["global_batch"], dtype, attention, rates=rates)
    rec = a.plan.choice.rung if a.plan.choice else Rung(3, "cpu", "cpu", True)
    micro = a.plan.choice.micro_batch if a.plan.choice else 1
    work = Workload(a["seq_len"], micro, dtype, attention)
    ckpt = rec.gradient_checkpointing

    def table(rungs: list[Rung], labels: list[str], title: str, legend: bool = False) -> str:
        estimates = [estimate_rung(model, r, work, hardware) for r in rungs]
        lines = [title, *memory_table(estimates, labels, hardware)]
        if legend:
            lines += term_legend(model, work, hardware)
            lines += why_sharding_costs_more(estimates)
        return "\n".join(lines)

    summary = "nothing fits; the leanest rung is the default" if a.plan.choice is None else f"recommended: {rec.name}"
    stages = [Rung(s, gradient_checkpointing=ckpt) for s in (0, 1, 2, 3)]
    with_ckpt = {False: "", "selective": ", selective checkpointing", True: ", gradient checkpointing"}[ckpt]
    w.ask("zero_stage", "ZeRO stage (0-3)", choice(0, 1, 2, 3), rec.stage,
          table(stages, [f"stage {s}" for s in range(4)],
                f"Micro-batch {micro}, {dtype}{with_ckpt}, {gpus_word(world)}; {summary}. Per GPU:", legend=True))
    stage = a["zero_stage"]
    offload = choice("none", "cpu", "nvme")
    if stage >= 1:
        options = [Rung(stage, dev, gradient_checkpointing=ckpt) for dev in ("none", "cpu")]
        w.ask("offload_optimizer", "Offload the optimizer (none/cpu/nvme)", offload,
              rec.offload_optimizer if rec.stage == stage else "none",
              table(options, ["none", "cpu"], f"stage {stage}, optimizer offload none or cpu:"))
    else:
        a.values["offload_optimizer"] = "none"
    if stage == 3:
        options = [Rung(3, a["offload_optimizer"], dev, ckpt) for dev in ("none", "cpu")]
        w.ask("offload_param", "Offload the parameters (none/cpu/nvme)", offload,
              rec.offload_param if rec.stage == 3 else "none",
              table(options, ["none", "cpu"], "stage 3, parameter offload none or cpu:"))
        w.ask("zero3_init", "Build the model partitioned with zero.Init (yes/no)", YES_NO, True,
              "  yes: each process holds 1/N of the weights while loading instead of the whole model")
    else:
        a.values["offload_param"], a.values["zero3_init"] = "none", False
    modes = [Rung(stage, a["offload_optimizer"], a["offload_param"], c) for c in (False, "selective", True)]
    w.ask("gradient_checkpointing", "Gradient checkpointing (no/selective/yes)", CHECKPOINTING, ckpt,
          table(modes, ["no", "selective", "yes"], f"{modes[0].name}, gradient checkpointing no, selective "
                "(matmul and attention outputs kept) or yes (whole layers):"))
    per_gpu = a["global_batch"] // world
    default_accum = per_gpu // micro if per_gpu % micro == 0 else per_gpu
    w.ask("gradient_accumulation_steps", "Gradient accumulation steps", divisor_of(per_gpu), default_accum,
          f"  global batch {a['global_batch']} = micro-batch x accumulation x {gpus_word(world)}")
    w.ask("gradient_clipping", "Gradient clipping (0: none)", NON_NEGATIVE, 1.0)
    chosen = Rung(stage, a["offload_optimizer"], a["offload_param"], a["gradient_checkpointing"])
    a.values["rung"] = chosen
    a.values["micro_batch"] = per_gpu // a["gradient_accumulation_steps"]
    a.values["dtype"] = dtype
    a.values["hardware"] = hardware
    a.values["estimate"] = estimate_rung(model, chosen, Workload(a["seq_len"], a["micro_batch"], dtype, attention),
                                         hardware)
    _run_questions(w, source)
    return a


def _run_questions(w: Wizard, source: str) -> None:
    """The run itself: written to both files, so each runs as is (`zerotrain train`, DeepSpeed)."""
    w.ask("lr", "Learning rate (AdamW, constant)", LEARNING_RATE, DEFAULT_LR)
    w.ask("max_steps", "Optimizer steps to train", positive_int(str(DEFAULT_MAX_STEPS)), DEFAULT_MAX_STEPS)
    w.ask("output_dir", "Run directory (checkpoints, metrics, the final model)", FOLDER, default_run_dir(source))


def gpus_word(n: int) -> str:
    """"1 GPU", "8 GPUs"."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def default_run_dir(source: str) -> str:
    """runs/<model name>: the model's file or folder name, or the architecture."""
    path = Path(source)
    name = path.stem if path.suffix in (".json", ".yaml", ".yml") else path.name
    if name in ("config", ""):  # a config.json inside its model folder: the folder's name
        name = path.resolve().parent.name
    return f"runs/{re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('-') or 'run'}"


def memory_table(estimates: list[RungEstimate], labels: list[str], hardware: Hardware) -> list[str]:
    """A line per term of the estimates (one column each), their totals, and whether each fits."""
    terms = [t for t in estimates[0].gpu if any(e.gpu.get(t, 0) for e in estimates)]
    width = max(len(t) for t in [*terms, "total", "CPU, per machine", "fits"]) + 2
    cell = max(11, *(len(label) + 1 for label in labels))  # "1024.0 GiB" and a space

    def row(name: str, cells: list[str]) -> str:
        return f"  {name:<{width}}" + "".join(f"{c:>{cell}}" for c in cells)

    lines = [row("", labels)]
    lines += [row(t, [format_bytes(e.gpu.get(t, 0)) if e.gpu.get(t, 0) else "-" for e in estimates]) for t in terms]
    lines.append(row("total", [format_bytes(e.gpu_total) for e in estimates]))
    if any(e.cpu_total for e in estimates):
        lines.append(row("CPU, per machine", [format_bytes(e.cpu_total) if e.cpu_total else "-" for e in estimates]))
    lines.append(row("fits", ["yes" if e.fits else "no" for e in estimates]))
    if hardware.gpu_memory is not None:
        usable = hardware.gpu_memory - hardware.gpu_reserve
        lines.append(wrap(f"fits: the total within {format_bytes(usable)} of each "
                          f"{format_bytes(hardware.gpu_memory)} GPU ({format_bytes(hardware.gpu_reserve)} kept for "
                          "CUDA, NCCL, fragmentation)", "  ", "    "))
    return lines


def term_legend(model: nn.Module, work: Workload, hardware: Hardware) -> list[str]:
    """What each line of a memory table is, with this job's numbers (shards, bucket and live limits)."""
    from zerotrain.config import load_config, resolve_config

    cfg = resolve_config(load_config(rung_config(Rung(3), work)), world_size=hardware.world_size, model=model)
    zero = cfg.zero_optimization
    low = 4 if work.dtype == "fp32" else 2
    values: dict[str, Any] = dict(n=hardware.world_size, dtype=work.dtype, bucket=zero.reduce_bucket_size,
                                  bucket_bytes=format_bytes(zero.reduce_bucket_size * low),
                                  live=zero.max_live_parameters, micro=work.micro_batch)
    width = max(len(t) for t in TERM_MEANINGS) + 2
    return ["What each line is:", *(wrap(f"{t:<{width}}{m.format(**values)}", "  ", " " * (width + 2))
                                    for t, m in TERM_MEANINGS.items())]


def why_sharding_costs_more(estimates: list[RungEstimate]) -> list[str]:
    """For stages 2-3 estimated above stage 1: the terms that grew against those that shrank, and the knob."""
    by_stage = {e.rung.stage: e for e in estimates}
    base = by_stage.get(1)
    if base is None:
        return []
    lines: list[str] = []
    grown: set[str] = set()
    for stage in (2, 3):
        e = by_stage.get(stage)
        if e is None or e.gpu_total <= base.gpu_total:
            continue
        change = {t: e.gpu.get(t, 0) - base.gpu.get(t, 0) for t in e.gpu}
        # Under 0.5% of the total is padding between bucket layouts, not a reason.
        least = base.gpu_total // 200
        grew = sorted(((t, d) for t, d in change.items() if d > least), key=lambda kv: -kv[1])
        shrank = sorted(((t, -d) for t, d in change.items() if -d > least), key=lambda kv: -kv[1])
        if not grew:
            continue
        grown |= {t for t, _ in grew}
        more = format_bytes(e.gpu_total - base.gpu_total)
        lines.append(wrap(f"Stage {stage} is estimated {more} above stage 1 here: "
                          + ", ".join(f"{t} +{format_bytes(d)}" for t, d in grew) + " outweigh "
                          + (", ".join(f"{t} -{format_bytes(d)}" for t, d in shrank) or "nothing saved") + ".",
                          "", "  "))
    whole = base.gpu.get("gradients", 0)  # stage 1 keeps the whole gradient
    buckets = max((by_stage[s].gpu.get("gradient buckets", 0) for s in (2, 3) if s in by_stage), default=0)
    if "gradient buckets" in grown and whole:
        lines.append(wrap(f"The buckets are sized in elements, not as a share of the model: here up to 3 hold "
                          f"{buckets / whole:.0%} of the whole gradient at once. A smaller "
                          "zero_optimization.reduce_bucket_size in ds_config.json shrinks them.", "  "))
    if "gathered units" in grown and whole:
        gathered = by_stage[3].gpu.get("gathered units", 0)
        lines.append(wrap("Stage 3 keeps layers gathered up to stage3_max_live_parameters: here "
                          f"{gathered / whole:.0%} of the weights. A smaller "
                          "zero_optimization.stage3_max_live_parameters shrinks them.", "  "))
    return lines


def wrap(text: str, indent: str, hanging: str | None = None, width: int = 100) -> str:
    """`text` folded at `width`, the first line indented by `indent`, the rest by `hanging` (default the same)."""
    import textwrap

    glued = text.replace(" GiB", "\0GiB").replace(" MiB", "\0MiB")  # a size never splits from its unit
    folded = textwrap.fill(glued, width, initial_indent=indent, subsequent_indent=hanging if hanging is not None
                           else indent, break_on_hyphens=False, break_long_words=False)
    return folded.replace("\0", " ")
