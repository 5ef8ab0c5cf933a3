"""A DeepSpeed checkpoint as a run that wrapped its model would have saved it: every parameter and
buffer name carries a prefix (DDP-style `module.`, torch.compile's `_orig_mod.`, a script's own
`model.`). Made from a real fixture by rewriting its files as plain data (torch.save), for the
strip_prefix tests: cheap, and the values stay the fixture's bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.deepspeed_pickle import as_plain_data, load_deepspeed_file


def wrapped_copy(save_dir: Path, dest: Path, prefix: str) -> Path:
    """Copies DeepSpeed save folder `save_dir` (with `latest` and one tag folder) to `dest`, each
    name prefixed with `prefix`; returns `dest`."""
    tag = (save_dir / "latest").read_text().strip()
    (dest / tag).mkdir(parents=True)
    shutil.copy(save_dir / "latest", dest / "latest")
    files = sorted((save_dir / tag).glob("*.pt"))
    names = _names(as_plain_data(load_deepspeed_file(next(f for f in files if f.name.endswith("model_states.pt")))))
    for path in files:
        torch.save(_renamed(as_plain_data(load_deepspeed_file(path)), names, prefix), dest / tag / path.name)
    return dest


def _names(model_state: dict) -> set[str]:
    """Every parameter and buffer name a model states file records."""
    groups = model_state.get("param_shapes") or []
    names = {n for group in (groups if isinstance(groups, list) else [groups]) for n in group}
    names |= set(model_state.get("module") or {}) | set(model_state.get("buffer_names") or [])
    return names | set(model_state.get("frozen_param_shapes") or {})


def _renamed(value: Any, names: set[str], prefix: str) -> Any:
    if isinstance(value, str):
        return prefix + value if value in names else value
    if isinstance(value, dict):
        return type(value)((_renamed(k, names, prefix), _renamed(v, names, prefix)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_renamed(v, names, prefix) for v in value)
    return value
