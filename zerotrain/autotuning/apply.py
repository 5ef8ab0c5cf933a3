"""How to use the winner: the exact `zerotrain train` YAML keys (and `--section.key VALUE` flags) it changes.

A trial's DeepSpeed config is the train YAML's `zero` section with the candidate's stage, offload
sections, micro-batch and accumulation put in (`search_space`). The train YAML keeps the batch in
`training`, and the trainer fills the DeepSpeed keys from there, so the overrides set `training`'s
keys and the ZeRO stage and offloads; a batch key the `zero` section sets itself is set there too,
or the trainer would report the two sides disagreeing.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Mapping

from zerotrain.config.errors import AUTO

OFFLOADS = ("offload_optimizer", "offload_param")
# DeepSpeed batch keys a `zero` section may set beside `training`'s, and the key of each in a trial config.
ZERO_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def winner_overrides(ds_config: Mapping[str, Any], gradient_checkpointing: bool | str,
                     base_zero: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], list[str]]:
    """(dotted key, value) pairs that turn the train YAML into the winner, and keys to delete by hand.

    `ds_config`: the winner's DeepSpeed config; `base_zero`: the YAML's `zero` section as written.
    """
    zero_opt = ds_config.get("zero_optimization") or {}
    base_opt = base_zero.get("zero_optimization") or {}
    pairs: list[tuple[str, Any]] = [
        ("training.micro_batch_size", ds_config["train_micro_batch_size_per_gpu"]),
        ("training.gradient_accumulation_steps", ds_config["gradient_accumulation_steps"]),
        ("training.gradient_checkpointing", gradient_checkpointing if gradient_checkpointing == "selective"
         else bool(gradient_checkpointing)),
    ]
    for key in ZERO_BATCH_KEYS:
        if key in base_zero and base_zero[key] != AUTO:
            pairs.append((f"zero.{key}", ds_config[key]))
    pairs.append(("zero.zero_optimization.stage", zero_opt.get("stage", 0)))
    for key in OFFLOADS:
        section = zero_opt.get(key)
        if section:
            pairs += [(f"zero.zero_optimization.{key}.{k}", v) for k, v in section.items()]
        elif base_opt.get(key) is not None:
            pairs.append((f"zero.zero_optimization.{key}", None))  # null: the winner does not offload
    bucket = zero_opt.get("reduce_bucket_size")
    if bucket is not None and bucket != base_opt.get("reduce_bucket_size"):
        pairs.append(("zero.zero_optimization.reduce_bucket_size", bucket))
    removals = []
    if not gradient_checkpointing and "activation_checkpointing" in base_zero:
        # Its presence alone turns the model's checkpointing on in `zerotrain train`; no value turns it off.
        removals.append("zero.activation_checkpointing (the winner runs without gradient checkpointing)")
    return pairs, removals


def yaml_value(value: Any) -> str:
    """A value as YAML (and a `--section.key VALUE` flag) reads it back: true, null, 4, 5e+08."""
    return json.dumps(value) if not isinstance(value, str) else value


def apply_lines(winner: str, yaml_path: str, pairs: list[tuple[str, Any]], removals: list[str],
                ds_config_path: str, within_noise: bool = False) -> list[str]:
    """The lines `zerotrain tune` prints after its verdict: keys to set, the same as flags, the JSON."""
    why = " (the first of those within noise)" if within_noise else ""
    lines = [f"Apply {winner}{why} to {yaml_path}: set these keys",
             *(f"  {key}: {yaml_value(value)}" for key, value in pairs)]
    lines += [f"  and delete {removal}" for removal in removals]
    flags = " ".join(f"--{key} {shlex.quote(yaml_value(value))}" for key, value in pairs)
    lines.append(f"or pass them as overrides: zerotrain train {shlex.quote(yaml_path)} {flags}")
    lines.append(f"DeepSpeed JSON of {winner} (for deepspeed.initialize or a ds_config file): {ds_config_path}")
    return lines
