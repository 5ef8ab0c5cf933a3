"""The paths a `zerotrain train` config holds, made absolute when the run writes its config.yaml,
so the written file runs from any folder."""

from __future__ import annotations

import copy
import os
from typing import Any

# Every key of a train config that holds a path, and the values of each that are not paths.
PATH_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("model", "path"): (), ("model", "config"): (), ("model", "tokenizer"): ("byte",),
    ("data", "path"): (), ("data", "eval_path"): (), ("data", "cache_dir"): (),
    ("training", "resume"): ("auto", "never"), ("logging", "tensorboard", "dir"): (), ("output", "dir"): (),
    ("logging", "compute_probe"): (), ("logging", "comm_probe"): (),
    ("zero", "zero_optimization", "offload_optimizer", "nvme_path"): (),
    ("zero", "zero_optimization", "offload_param", "nvme_path"): (),
}


def absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a config as plain data) with every relative path made absolute from this folder."""
    data = copy.deepcopy(data)
    for keys, not_paths in PATH_KEYS.items():
        holder = data
        for key in keys[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        value = holder.get(keys[-1]) if isinstance(holder, dict) else None
        if isinstance(value, str) and value and value not in not_paths:
            holder[keys[-1]] = os.path.abspath(os.path.expanduser(value))
    return data
