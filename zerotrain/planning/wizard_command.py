"""`zerotrain init [MODEL]`: the config wizard, writing a DeepSpeed JSON, a train YAML, an Accelerate YAML.

Every question of `config_wizard` has a flag; `--yes` takes the recommended answer for the
rest, so `zerotrain init MODEL --gpus-per-node 8 --gpu-memory 80GiB --yes` writes the plan's
configs at once. The files agree: the optimizer (learning rate included) is written to both from
one place (`optimizer_params`), and the train YAML runs as is (steps, run directory, data).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from zerotrain.config.flag_spellings import GPUS_PER_NODE, NODES, add_shared_flag
from zerotrain.system.durable_files import atomic_write_text

if TYPE_CHECKING:
    from zerotrain.planning.wizard_questions import Answers

# Machines and GPUs per machine are spelled as in every other command (config/flag_spellings.py).
_LAYOUT_FLAGS = (("num_machines", NODES, "machines (nodes)"), ("gpus_per_machine", GPUS_PER_NODE, "GPUs per machine"))
_QUESTION_FLAGS = (
    ("--gpu-memory", "memory of one GPU, e.g. 80GiB (GiB = 2^30 bytes, GB = 10^9; default: this machine's; "
                     "none without a GPU)"),
    ("--cpu-memory", "CPU memory of one machine, e.g. 512GiB"),
    ("--seq-len", "tokens per sample"), ("--global-batch", "samples per optimizer step over all GPUs"),
    ("--mixed-precision", "no, fp16 or bf16"), ("--zero-stage", "0-3"),
    ("--offload-optimizer", "none, cpu or nvme"), ("--offload-param", "none, cpu or nvme (stage 3)"),
    ("--zero3-init", "yes or no (stage 3)"), ("--gradient-checkpointing", "yes or no"),
    ("--gradient-accumulation-steps", "steps per optimizer step"), ("--gradient-clipping", "max gradient norm, 0: none"),
    ("--lr", "learning rate, written to both files (default 3e-4)"), ("--max-steps", "optimizer steps to train"),
    ("--output-dir", "the run directory of zerotrain train (default runs/<model name>)"),
)


def add_init_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `init` to the `zerotrain` command."""
    parser = subparsers.add_parser(
        "init",
        help="config wizard: answer accelerate config's questions, each shown with its memory estimate",
        description="Ask the questions `accelerate config` asks for DeepSpeed (machines, GPUs, ZeRO stage, offload, "
        "zero.Init, accumulation, clipping, mixed precision), each with the memory estimate behind it and the "
        "plan's recommendation as default, then the learning rate, steps and run directory; write a DeepSpeed "
        "JSON, a zerotrain train YAML that runs as is and, on request, an Accelerate config. Answers come from "
        "the flags, then standard input (an empty line takes the default in brackets; a wrong answer is asked "
        "again with the answers it accepts).",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="a local Hugging Face directory or config.json, a zerotrain train YAML, or an "
                        "architecture name sized with --config-override (asked when left out)")
    parser.add_argument("--config-override", action="append", default=[], metavar="KEY=VALUE", dest="config_overrides",
                        help="a model config value, e.g. hidden_size=4096; repeatable")
    for dest, names, what in _LAYOUT_FLAGS:
        add_shared_flag(parser, names, dest=dest, metavar="ANSWER", default=None, help=what)
    for flag, what in _QUESTION_FLAGS:
        parser.add_argument(flag, metavar="ANSWER", default=None, help=what)
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="attention kernel (default sdpa)")
    parser.add_argument("--nvme", metavar="PATH", default=None, help="a local NVMe folder for NVMe offload")
    from zerotrain.planning.speed_args import add_speed_args

    add_speed_args(parser)  # the recommendation is the fastest fitting configuration, as `zerotrain plan` picks
    parser.add_argument("-y", "--yes", action="store_true", help="take the recommended answer for every question "
                        "a flag does not answer")
    parser.add_argument("--output-deepspeed", default="ds_config.json", metavar="PATH",
                        help="the DeepSpeed JSON to write (default ds_config.json)")
    parser.add_argument("--output-train", default="zerotrain.yaml", metavar="PATH",
                        help="the zerotrain train YAML to write (default zerotrain.yaml)")
    parser.add_argument("--accelerate-config", default=None, metavar="PATH",
                        help="also write an Accelerate config YAML that uses the DeepSpeed JSON")
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")
    parser.set_defaults(handler=run_init)


def run_init(args: argparse.Namespace) -> int:
    """0: configs written; 1: a config that does not fit was not confirmed; 2: a wrong answer or file."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.planning.config_wizard import SPEED_KEYS, Wizard, WizardError, run_questions
    from zerotrain.planning.wizard_questions import YES_NO, model_kind

    outputs = [Path(p) for p in (args.output_deepspeed, args.output_train, args.accelerate_config) if p]
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not args.force:
        print_user_error("zerotrain init", ValueError(f"{existing[0]} exists; pass --force to overwrite it"))
        return USAGE_EXIT_CODE
    flags = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in _QUESTION_FLAGS}
    flags.update({dest: getattr(args, dest) for dest, _, _ in _LAYOUT_FLAGS})
    flags.update(attention=args.attention, nvme=args.nvme, model=args.model,
                 speed={k: getattr(args, k) for k in SPEED_KEYS})
    names = {"model": "MODEL", **{dest: spellings[0] for dest, spellings, _ in _LAYOUT_FLAGS}}
    wizard = Wizard(flags, assume_defaults=args.yes, flag_names=names)
    try:
        load = _model_loader(args.config_overrides)
        source = wizard.ask("model", "Model (a Hugging Face directory, config.json, train YAML or architecture)",
                            model_kind(load), "llama")
        answers = run_questions(wizard, load(source), source)
        estimate = answers["estimate"]
        if not estimate.fits:
            print(f"Warning: {answers['rung'].name} at micro-batch {answers['micro_batch']} does not fit: "
                  + "; ".join(estimate.overflow))
            if not wizard.ask("confirm", "Write it anyway (yes/no)", YES_NO, False):
                print("Nothing written.")
                return 1
    except (WizardError, ConfigError, ValueError) as error:
        print_user_error("zerotrain init", error)
        return USAGE_EXIT_CODE
    ds = deepspeed_config(answers)
    train_yaml = Path(args.output_train)
    _write(Path(args.output_deepspeed), json.dumps(ds, indent=2) + "\n")
    _write(train_yaml, train_header(answers, train_yaml, args.output_deepspeed)
           + yaml.safe_dump(train_config(answers, source, args.config_overrides, ds), sort_keys=False))
    if args.accelerate_config:
        _write(Path(args.accelerate_config), yaml.safe_dump(accelerate_config(answers, args.output_deepspeed),
                                                            sort_keys=False))
    e = answers["estimate"]
    print(f"\n{answers['rung'].name}, micro-batch {answers['micro_batch']} x {answers['gradient_accumulation_steps']} "
          f"accumulation: {format_gib(e.gpu_total)} per GPU. Wrote {', '.join(str(p) for p in outputs)}.")
    print(f"Train: zerotrain train {train_yaml} (synthetic data: set data.path in it to train on your text)")
    return 0


def _model_loader(config_overrides: list[str]) -> Callable[[str], Any]:
    """`load(source)`: the model on the meta device, built once per source; BadAnswer saying why not."""
    from zerotrain.planning.model_source import load_meta_model, parse_config_overrides
    from zerotrain.planning.wizard_questions import BadAnswer

    overrides = parse_config_overrides(config_overrides)  # a wrong --config-override stops here, once
    built: dict[str, Any] = {}

    def load(source: str):
        if source not in built:
            try:
                built[source] = load_meta_model(source, overrides)
            except ValueError as error:
                raise BadAnswer(str(error)) from None
            except Exception as error:  # noqa: BLE001 - a config transformers cannot read: ask again
                raise BadAnswer(f"{type(error).__name__}: {error}") from None
        return built[source]
    return load


# The optimizer both files describe: zerotrain train's own AdamW defaults, the learning rate asked.
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.0


def optimizer_params(a: Answers) -> dict[str, Any]:
    """The one source of the optimizer's settings written to ds_config.json and zerotrain.yaml alike."""
    return {"lr": a["lr"], "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS, "weight_decay": ADAMW_WEIGHT_DECAY}


def deepspeed_config(a: Answers) -> dict[str, Any]:
    """The answers as a DeepSpeed JSON: batch sizes explicit, the chosen ZeRO section, the optimizer.

    No scheduler: DeepSpeed then keeps the learning rate constant, as the train YAML's
    `lr_schedule: constant` does."""
    from zerotrain.planning.rung_memory import Workload, rung_config

    work = Workload(a["seq_len"], a["micro_batch"], a["dtype"])
    cfg = rung_config(a["rung"], work, None, a.values["hardware"].nvme_path)
    cfg["optimizer"] = {"type": "AdamW", "params": optimizer_params(a)}
    cfg["gradient_accumulation_steps"] = a["gradient_accumulation_steps"]
    cfg["train_batch_size"] = a["global_batch"]
    if a["gradient_clipping"]:
        cfg["gradient_clipping"] = a["gradient_clipping"]
    return cfg


def train_config(a: Answers, source: str, overrides: list[str], ds: dict[str, Any]) -> dict[str, Any]:
    """A `zerotrain train` YAML that runs as is: the model, synthetic data to replace, the batch, the
    optimizer of `ds`, the steps, the ZeRO section and an absolute run directory."""
    from zerotrain.planning.model_source import parse_config_overrides

    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        head: dict[str, Any] = {"inherit": [str(path.resolve())]}
    else:
        key = "path" if path.is_dir() and (path / "model.safetensors").exists() else (
            "config" if path.suffix == ".json" or path.is_dir() else "architecture")
        model: dict[str, Any] = {key: str(path.resolve()) if key != "architecture" else source}
        if overrides:
            model["config_overrides"] = parse_config_overrides(overrides)
        head = {"model": model, "data": {"format": "synthetic", "seq_len": a["seq_len"]}}
    optimizer = ds["optimizer"]["params"]
    return {
        **head,
        "training": {
            "micro_batch_size": a["micro_batch"],
            "gradient_accumulation_steps": a["gradient_accumulation_steps"],
            "max_steps": a["max_steps"],
            "lr": optimizer["lr"],
            "lr_schedule": "constant",  # ds_config.json has no scheduler: DeepSpeed keeps lr constant too
            "warmup_steps": 0,
            "betas": list(optimizer["betas"]),
            "eps": optimizer["eps"],
            "weight_decay": optimizer["weight_decay"],
            "gradient_checkpointing": a["gradient_checkpointing"],
            "precision": a["dtype"],
            "grad_clip": a["gradient_clipping"],
        },
        "zero": {"zero_optimization": ds["zero_optimization"]},
        # Absolute: the YAML runs from any folder (output paths are read relative to the working directory).
        "output": {"dir": str(Path(a["output_dir"]).expanduser().resolve())},
    }


def train_header(a: Answers, train_yaml: Path, deepspeed_json: str) -> str:
    """Comments above the train YAML: how to run it and what to change before a real run."""
    from zerotrain.planning.config_wizard import gpus_word

    hardware = a.values["hardware"]
    where = (f"zerotrain train {train_yaml.name} --hostfile FILE (one 'HOST slots={hardware.gpus_per_node}' line "
             "per machine)" if hardware.nodes > 1 else
             f"zerotrain train {train_yaml.name} (it takes every GPU of the machine: {hardware.gpus_per_node} asked)")
    return (
        f"# Written by zerotrain init: {a['rung'].name}, micro-batch {a['micro_batch']} x "
        f"{a['gradient_accumulation_steps']} accumulation x {gpus_word(hardware.world_size)}.\n"
        f"# Run it: {where}\n"
        "# data: generated arithmetic, so that it runs as is; set data.path (a file or folder of text,\n"
        "#   jsonl or parquet) to train on yours.\n"
        "# model: trained from scratch unless model.path is a local Hugging Face directory with weights.\n"
        f"# lr, betas, eps, weight_decay: the optimizer of {Path(deepspeed_json).name}; change both together.\n"
    )


def accelerate_config(a: Answers, deepspeed_json: str) -> dict[str, Any]:
    """An `accelerate config` file that hands the DeepSpeed JSON to Accelerate."""
    hardware = a.values["hardware"]
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "deepspeed_config": {
            "deepspeed_config_file": str(Path(deepspeed_json).resolve()),
            "deepspeed_multinode_launcher": "standard",
            "zero3_init_flag": bool(a["zero3_init"]),
        },
        "distributed_type": "DEEPSPEED",
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": hardware.nodes,
        "num_processes": hardware.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }


def format_gib(n: int) -> str:
    from zerotrain.config.byte_sizes import format_bytes

    return format_bytes(n)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)  # a config is never left half written
