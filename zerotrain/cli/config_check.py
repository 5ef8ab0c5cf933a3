"""`zerotrain config check`: validate a config; a one-line verdict, or with --show the whole
config with every value resolved.

A DeepSpeed config (JSON with comments, or YAML) has its "auto" values resolved for a world
size (``--set`` fills the ones that need a model or data).  A `zerotrain train` YAML (top-level
sections model, data, training, zero, logging, output or inherit) is merged with the files it
inherits, overridden by ``--set`` and validated as `zerotrain train` would, and printed with
every default filled in.  Either way a problem is one message naming the file and key (exit 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.json import JSON
from rich.markup import escape

from zerotrain.config.error_report import (
    USAGE_EXIT_CODE,
    error_console,
    print_user_error,
)
from zerotrain.config.overrides import parse_key_values

# Top-level keys that make a YAML file a `zerotrain train` config rather than a DeepSpeed one.
TRAIN_CONFIG_KEYS = frozenset({"inherit", "model", "data", "training", "zero", "logging", "output"})


def parse_overrides(items: Sequence[str]) -> dict[str, object]:
    """Turns ``["a.b=1e-3", "c=x"]`` into ``{"a.b": 0.001, "c": "x"}`` (config/overrides.py reads the values)."""
    return parse_key_values(items, "--set", "scheduler.params.total_num_steps=100")


_MISSING = object()


def _value_at(data: object, dotted_key: str) -> object:
    """`data["a"]["b"]` for "a.b", or `_MISSING` when the path is absent."""
    for part in dotted_key.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def run_config_check(args: argparse.Namespace) -> int:
    """`zerotrain config check`: prints the resolved config (0), or why it is invalid (2)."""
    from zerotrain.config import ConfigError, load_config, resolve_config

    console = error_console()
    try:
        if is_train_config(args.path):
            return _check_train_config(args, console)
        if args.write_json:
            return _write_plain_json(args.path, args.write_json)
        overrides = parse_overrides(args.overrides)
        cfg = resolve_config(load_config(args.path), world_size=args.world_size, model=None, auto_values=overrides)
    except (ConfigError, ValueError, OSError) as error:
        # The message is the whole story (it names the file, key and fix); a traceback would bury it.
        print_user_error("zerotrain config check", error, console)
        if '"auto"' in str(error):
            console.print('[dim]fill "auto" values here with --set KEY=VALUE[/]')
        return USAGE_EXIT_CODE
    resolved = cfg.model_dump(mode="json", exclude_none=True)
    for key, value in overrides.items():
        # resolve_config fills only "auto" values and ignores other keys: say so.
        if _value_at(resolved, key) != value:
            console.print(
                f"[yellow]--set {escape(key)} had no effect: only values the config sets to \"auto\" are filled[/]"
            )
    if not args.show:
        print(_deepspeed_verdict(args.path, resolved, args.world_size))
        return 0
    # soft_wrap: long strings must not be folded, so the output stays valid JSON.
    Console().print(JSON.from_data(resolved), soft_wrap=True)
    return 0


def _write_plain_json(path: str, out: str) -> int:
    """--write-json: the config as plain JSON (comments dropped, "auto" kept) for json.load readers."""
    import json

    from zerotrain.config import load_config
    from zerotrain.config.loader import read_config_file

    data = read_config_file(Path(path))
    load_config(path)  # a config zerotrain refuses is not worth copying
    Path(out).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"{out}: {path} as plain JSON (no comments), which transformers and Accelerate read with json.load")
    return 0


def _deepspeed_verdict(path: str, resolved: dict, world_size: int) -> str:
    """One line: valid, and the settings a reader checks first."""
    zero = resolved.get("zero_optimization") or {}
    dtype = next((d for d in ("bf16", "fp16") if (resolved.get(d) or {}).get("enabled")), "fp32")
    offload = [f"{what} to {section.get('device')}" for what, section in
               (("optimizer", zero.get("offload_optimizer") or {}), ("parameters", zero.get("offload_param") or {}))
               if section.get("device") not in (None, "none")]
    optimizer = (resolved.get("optimizer") or {}).get("type")
    return (
        f"{path}: valid DeepSpeed config for {world_size} rank{'s' if world_size != 1 else ''}: ZeRO stage "
        f"{zero.get('stage', 0)}, {dtype}, train batch {resolved.get('train_batch_size')} = micro-batch "
        f"{resolved.get('train_micro_batch_size_per_gpu')} x {resolved.get('gradient_accumulation_steps')} "
        f"accumulation x {world_size}" + (f", offload {' and '.join(offload)}" if offload else "")
        + (f", optimizer {optimizer}" if optimizer else "") + " (--show prints it resolved)"
    )


def is_train_config(path: str | os.PathLike) -> bool:
    """Whether PATH is a `zerotrain train` YAML (its top-level keys are train sections), not a DeepSpeed config."""
    from zerotrain.config.loader import read_config_file

    file = Path(path)
    if file.suffix.lower() not in (".yaml", ".yml") or not file.is_file():
        return False
    data = read_config_file(file)
    return isinstance(data, dict) and not TRAIN_CONFIG_KEYS.isdisjoint(data)


def _check_train_config(args: argparse.Namespace, console: Console) -> int:
    """A `zerotrain train` YAML: merged, overridden by --set, validated; printed as YAML with defaults filled."""
    import yaml

    from zerotrain.config import ConfigError, check_supported
    from zerotrain.train.config_files import load_train_config

    overrides = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides.append(f"--{key.strip()}={value}")
    cfg = load_train_config(args.path, overrides)
    # What the trainer would refuse only after its workers have started: a misspelt architecture,
    # features not built, DeepSpeed monitor sections.  Every problem is reported at once.
    from zerotrain.train.model import check_model_config

    problems = _problem(check_model_config, cfg.model)
    problems += _problem(lambda: check_supported(cfg.zero_config(), prefix="zero."))
    if len(problems) == 1:
        raise ConfigError(f"{args.path}: {problems[0]}")
    if problems:
        raise ConfigError(f"{args.path}:\n" + "\n".join(f"  {p}" for p in problems))
    for note in cfg.notes:
        console.print(f"[dim]{escape(note)}[/]")
    if args.show:
        print(yaml.safe_dump(cfg.as_dict(), sort_keys=False, allow_unicode=True), end="")
        return 0
    model = cfg.model
    source = (f"model.path {model.path}" if model.path else f"model.config {model.config}" if model.config
              else f"architecture {model.architecture}")
    data = f"data {cfg.data.path}" if cfg.data.path else f"synthetic {cfg.data.synthetic.task} data"
    length = (f"{cfg.training.max_steps} steps" if cfg.training.max_steps else f"{cfg.training.epochs:g} epochs")
    stage = (cfg.zero.get("zero_optimization") or {}).get("stage", 0)
    print(f"{args.path}: valid zerotrain train config: {source}, {data}, ZeRO stage {stage}, {length}, "
          f"output {cfg.output.dir} (--show prints it with every default filled in)")
    return 0


def _problem(check, *args) -> list[str]:
    """The message of the ConfigError `check(*args)` raises, as a list of none or one."""
    from zerotrain.config import ConfigError

    try:
        check(*args)
    except ConfigError as error:
        return [str(error)]
    return []


def add_config_parser(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser(
        "config", help="work with DeepSpeed and zerotrain train config files",
        description="Work with DeepSpeed and zerotrain train config files.",
    )
    config_commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = config_commands.add_parser(
        "check",
        help="validate a config and print it with every value resolved",
        description="Load a DeepSpeed config (JSON, with comments allowed), resolve its \"auto\" "
        "values for the given world size and print the result. A zerotrain train YAML (sections model, "
        "data, training, zero, logging, output, or inherit) is merged with the files it inherits, "
        "validated and printed with every default filled in (--world-size applies to DeepSpeed configs only). "
        "Exits 2 with the reason when the config is invalid.",
    )
    check.add_argument("path", metavar="PATH", help="the config file")
    check.add_argument("--show", action="store_true",
                       help="print the whole config, every value resolved (default: a one-line verdict)")
    check.add_argument(
        "--world-size",
        "--world_size",
        dest="world_size",
        type=int,
        default=1,
        metavar="N",
        help="number of ranks to resolve batch sizes for (default: %(default)s)",
    )
    check.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='value for a key the config sets to "auto", dotted, e.g. scheduler.params.total_num_steps=100; '
        "VALUE is read as JSON when it parses (1e-3, true, [1,2]), else as a string. For a zerotrain train "
        "YAML, any key: the same as --section.key VALUE on zerotrain train. Repeatable.",
    )
    check.add_argument("--write-json", "--write_json", dest="write_json", default=None, metavar="OUT",
                       help="write a DeepSpeed config to OUT as plain JSON (comments dropped, \"auto\" kept), "
                       "for transformers and Accelerate, which read it with json.load")
    check.set_defaults(handler=run_config_check)
