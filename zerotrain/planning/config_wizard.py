"""The config wizard's questions: `accelerate config`'s, each answered with the estimate behind it.

A `Wizard` asks in order; an answer comes from its flag when given, else from standard input
(one line per answer; an empty line takes the default), else, with `--yes` or once input has
ended, the default. Defaults come from `make_plan`: the fastest configuration that fits. A
wrong answer typed at the prompt is asked again with the reason; a wrong flag, or one read from
exhausted input, stops the wizard with it (`WizardError`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from zerotrain.planning.ladder import Rung
from zerotrain.planning.planner import Plan, make_plan
from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung, format_bytes, parse_size


class WizardError(ValueError):
    """An answer that cannot be used, named with the question it answered."""


@dataclass
class Answers:
    """What the wizard has learned so far."""

    values: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


@dataclass
class Wizard:
    """Asks questions on `out`, reading answers from `inp`, flags first."""

    flags: dict[str, Any]
    assume_defaults: bool = False
    # Looked up when a wizard is made, so redirected streams are the ones used.
    inp: TextIO = field(default_factory=lambda: sys.stdin)
    out: TextIO = field(default_factory=lambda: sys.stdout)
    answers: Answers = field(default_factory=Answers)
    _input_ended: bool = False

    def ask(self, key: str, prompt: str, parse: Callable[[str], Any], default: Any, note: str = "") -> Any:
        """One question: its note (the estimate), the prompt with its default, the parsed answer."""
        if note:
            print(note, file=self.out)
        shown = _show(default)
        if self.flags.get(key) is not None:
            value = self._parse(key, parse, str(self.flags[key]), source="flag")
            print(f"{prompt} [{shown}]: {_show(value)} (from --{key.replace('_', '-')})", file=self.out)
            return self._keep(key, value)
        while True:
            print(f"{prompt} [{shown}]: ", end="", file=self.out, flush=True)
            line = None if (self.assume_defaults or self._input_ended) else self.inp.readline()
            if line == "":
                self._input_ended = True
            if not line or not line.strip():
                print(f"{shown}", file=self.out)
                return self._keep(key, default)
            text = line.strip()
            print(text, file=self.out)
            try:
                return self._keep(key, self._parse(key, parse, text, source="answer"))
            except WizardError as error:
                print(f"  {error}; try again", file=self.out)

    def _parse(self, key: str, parse: Callable[[str], Any], text: str, source: str) -> Any:
        try:
            return parse(text)
        except (ValueError, TypeError) as error:
            where = f"--{key.replace('_', '-')}" if source == "flag" else key.replace("_", " ")
            raise WizardError(f"{where} {text!r}: {error}") from None

    def _keep(self, key: str, value: Any) -> Any:
        self.answers.values[key] = value
        return value


def run_questions(w: Wizard, model, source: str) -> Answers:
    """Every question in `accelerate config`'s order (after the machines, the model's workload)."""
    a = w.answers
    w.ask("num_machines", "How many machines?", positive_int, 1)
    w.ask("gpus_per_machine", "How many GPUs per machine?", positive_int, 1)
    w.ask("gpu_memory", "Memory of one GPU", parse_size, parse_size("80GB"))
    w.ask("cpu_memory", "CPU memory of one machine (0: do not check)", _size_or_none, None)
    world = a["num_machines"] * a["gpus_per_machine"]
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 2048)
    w.ask("seq_len", "Sequence length (tokens per sample)", positive_int, min(2048, limit))
    w.ask("global_batch", "Global batch (samples per optimizer step, all GPUs)", _multiple_of(world), 8 * world)
    w.ask("mixed_precision", "Mixed precision (no/fp16/bf16)", _choice("no", "fp16", "bf16"), "bf16")
    hardware = Hardware(a["gpus_per_machine"], a["num_machines"], a["gpu_memory"], a["cpu_memory"], w.flags.get("nvme"))
    dtype = "fp32" if a["mixed_precision"] == "no" else a["mixed_precision"]
    a.plan = make_plan(model, hardware, a["seq_len"], a["global_batch"], dtype, w.flags.get("attention") or "sdpa")
    rec = a.plan.choice.rung if a.plan.choice else Rung(3, "cpu", "cpu", True)
    micro = a.plan.choice.micro_batch if a.plan.choice else 1
    work = Workload(a["seq_len"], micro, dtype, w.flags.get("attention") or "sdpa")

    def line(rung: Rung) -> str:
        e = estimate_rung(model, rung, work, hardware)
        verdict = "fits" if e.fits else "does not fit"
        return f"  {rung.name}: {format_bytes(e.gpu_total)} of {format_bytes(hardware.gpu_memory)} per GPU — {verdict}"

    ckpt = rec.gradient_checkpointing
    notes = [line(Rung(s, gradient_checkpointing=ckpt)) for s in (0, 1, 2, 3)]
    summary = "nothing fits; the leanest rung is the default" if a.plan.choice is None else f"recommended: {rec.name}"
    w.ask("zero_stage", "ZeRO stage (0-3)", _choice(0, 1, 2, 3), rec.stage,
          f"Micro-batch {micro}, {dtype}; {summary}\n" + "\n".join(notes))
    stage = a["zero_stage"]
    if stage >= 1:
        options = [Rung(stage, dev, gradient_checkpointing=ckpt) for dev in ("none", "cpu")]
        w.ask("offload_optimizer", "Offload the optimizer (none/cpu/nvme)", _choice("none", "cpu", "nvme"),
              rec.offload_optimizer if rec.stage == stage else "none", "\n".join(line(r) for r in options))
    else:
        a.values["offload_optimizer"] = "none"
    if stage == 3:
        options = [Rung(3, a["offload_optimizer"], dev, ckpt) for dev in ("none", "cpu")]
        w.ask("offload_param", "Offload the parameters (none/cpu/nvme)", _choice("none", "cpu", "nvme"),
              rec.offload_param if rec.stage == 3 else "none", "\n".join(line(r) for r in options))
        w.ask("zero3_init", "Build the model partitioned with zero.Init (yes/no)", _yes_no, True,
              "  yes: each process holds 1/N of the weights while loading instead of the whole model")
    else:
        a.values["offload_param"], a.values["zero3_init"] = "none", False
    chosen = Rung(stage, a["offload_optimizer"], a["offload_param"], ckpt)
    both = [line(Rung(stage, a["offload_optimizer"], a["offload_param"], c)) for c in (False, True)]
    w.ask("gradient_checkpointing", "Gradient checkpointing (yes/no)", _yes_no, ckpt, "\n".join(both))
    per_gpu = a["global_batch"] // world
    default_accum = per_gpu // micro if per_gpu % micro == 0 else per_gpu
    w.ask("gradient_accumulation_steps", "Gradient accumulation steps", _divisor_of(per_gpu), default_accum,
          f"  global batch {a['global_batch']} = micro-batch x accumulation x {world} GPUs")
    w.ask("gradient_clipping", "Gradient clipping (0: none)", _non_negative_float, 1.0)
    chosen = Rung(stage, a["offload_optimizer"], a["offload_param"], a["gradient_checkpointing"])
    a.values["rung"] = chosen
    a.values["micro_batch"] = per_gpu // a["gradient_accumulation_steps"]
    a.values["dtype"] = dtype
    a.values["hardware"] = hardware
    a.values["estimate"] = estimate_rung(model, chosen, Workload(a["seq_len"], a["micro_batch"], dtype,
                                                                  work.attention), hardware)
    return a


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "none"
    if isinstance(value, int) and value >= 2**30 and value % 2**20 == 0:
        return format_bytes(value).replace(" ", "")
    return str(value)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _size_or_none(text: str) -> int | None:
    return None if text.strip() in ("0", "none") else parse_size(text)


def _multiple_of(n: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = positive_int(text)
        if value % n:
            raise ValueError(f"must be a multiple of the {n} GPUs")
        return value
    return parse


def _divisor_of(n: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = positive_int(text)
        if n % value:
            raise ValueError(f"must divide the {n} samples each GPU takes per step")
        return value
    return parse


def _choice(*options: Any) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        for option in options:
            if text.strip().lower() == str(option):
                return option
        raise ValueError(f"answer one of {', '.join(str(o) for o in options)}")
    return parse


def _yes_no(text: str) -> bool:
    word = text.strip().lower()
    if word in ("y", "yes", "true", "1"):
        return True
    if word in ("n", "no", "false", "0"):
        return False
    raise ValueError("answer yes or no")


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value
