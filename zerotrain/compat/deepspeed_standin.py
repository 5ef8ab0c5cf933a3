"""The `deepspeed` stand-in: a real `deepspeed` package, shipped inside zerotrain, that
hands out zerotrain's own objects (`deepspeed.DeepSpeedEngine` *is* `zerotrain.runtime.engine.Engine`).

It lives in `zerotrain/compat/standin/` (the `deepspeed` package, its `.dist-info` metadata and a
`deepspeed` command), a folder that is never on `sys.path` by itself: `import zerotrain`
changes nothing. `zerotrain run` and `zerotrain launch` put it first on `PYTHONPATH` and
`PATH` for the processes they start, so a Hugging Face Trainer or Accelerate script that
imports `deepspeed` gets zerotrain, even where a real DeepSpeed is installed beside it.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "standin"
"""Holds the `deepspeed` package and `deepspeed-<version>.dist-info`; goes first on PYTHONPATH."""

COMMANDS_DIR = STANDIN_DIR / "bin"
"""Holds a `deepspeed` command (DeepSpeed's launcher name, running `zerotrain launch`); first on PATH."""

VERSION = "0.19.8"
"""The DeepSpeed version the stand-in reports; `standin/deepspeed-<VERSION>.dist-info` must match it
(tests/hf/test_standin.py checks). At or above what transformers (0.9.3), Accelerate (0.14.5 for its
no-ssh multi-node launcher, 0.18.2 for Ulysses sequence parallelism, which the stand-in has) and
Lightning (0.16.0 with torch >= 2.6) require; 0.19.8 is the DeepSpeed whose `ulysses_sp` API the
stand-in copies. It also opens Accelerate's AutoTP path (>= 0.16.4): zerotrain refuses tensor
parallelism itself (`tensor_parallel` in the config, `tp_model_init`) before any rank trains."""

ACTIVE_ENV = "ZEROTRAIN_DEEPSPEED_STANDIN"
"""Set to 1 in the processes the stand-in was activated for (ranks report it in errors)."""


PYTHON_ENV = "ZT_STANDIN_PYTHON"
"""The interpreter the `deepspeed` command runs zerotrain with (not ZEROTRAIN_-prefixed: the
launcher exports those to other nodes, where the interpreter may live elsewhere)."""


def _prepend(value: str | None, entry: Path) -> str:
    parts = [p for p in (value or "").split(os.pathsep) if p and Path(p) != entry]
    return os.pathsep.join([str(entry), *parts])


def with_standin(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` where `import deepspeed` and the `deepspeed` command mean zerotrain."""
    out = dict(env)
    out["PYTHONPATH"] = _prepend(env.get("PYTHONPATH"), STANDIN_DIR)
    out["PATH"] = _prepend(env.get("PATH"), COMMANDS_DIR)
    out[ACTIVE_ENV] = "1"
    out[PYTHON_ENV] = sys.executable  # for the `deepspeed` command
    return out


def activate_in_this_process() -> None:
    """Makes `import deepspeed` in this process return the stand-in (tests, notebooks).

    A real `deepspeed` already imported here cannot be replaced: that is an error.
    """
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not getattr(loaded, "__zerotrain_standin__", False):
        raise RuntimeError(
            "a real DeepSpeed is already imported in this process; activate the zerotrain stand-in "
            "before anything imports deepspeed (or start the script with `zerotrain run`)"
        )
    entry = str(STANDIN_DIR)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    os.environ.update(with_standin(dict(os.environ)))
    importlib.invalidate_caches()
