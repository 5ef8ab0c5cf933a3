"""A torch.compile (dynamo) setting on Accelerate's DeepSpeed path: said, never silently dropped.

zerotrain does not compile the engine yet. Accelerate's DeepSpeed launcher already drops the
dynamo backend of the command line and of the config file (it never passes it to the ranks),
without a word; ACCELERATE_DYNAMO_BACKEND in the environment does reach the ranks, where
Accelerate would call `engine.compile(backend=..., compile_kwargs=...)` and every rank would
stop with a TypeError. `zerotrain run` names each such setting in one warning and runs eager:
the environment variable is left out of the job's environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zerotrain.compat.accelerate_launch_args import AccelerateLaunch, Setting

DYNAMO_ENV = "ACCELERATE_DYNAMO_BACKEND"


@dataclass(frozen=True)
class IgnoredCompileSettings:
    """The dynamo settings a DeepSpeed launch will not apply, and the variables to leave out of its environment."""

    settings: list[Setting]
    drop_env: list[str]

    def warning(self) -> str:
        """One message: each setting with its source, that it is not applied, and how to silence it."""
        named = "; ".join(f"dynamo backend {s.value!r} ({s.source})" for s in self.settings)
        return (
            f"{named}: not applied. torch.compile is not yet supported on zerotrain's DeepSpeed path, so "
            "this run continues eager" + (f" ({', '.join(self.drop_env)} is left out of its environment)"
                                          if self.drop_env else "")
            + ". To silence this, set the dynamo backend to \"no\" where it is given."
        )


def ignored_compile_settings(launch: AccelerateLaunch, env: Mapping[str, str]) -> IgnoredCompileSettings | None:
    """The dynamo backends other than "no" that this DeepSpeed launch asks for, or None when there are none."""
    if not launch.uses_deepspeed:
        return None
    settings = []
    chosen = launch.setting("dynamo_backend", "dynamo_backend", "dynamo_config")
    if chosen is not None and _compiles(chosen.value):
        settings.append(chosen)
    drop_env = []
    if _compiles(env.get(DYNAMO_ENV, "no")):
        settings.append(Setting(env[DYNAMO_ENV], f"{DYNAMO_ENV} in the environment"))
        drop_env.append(DYNAMO_ENV)
    return IgnoredCompileSettings(settings, drop_env) if settings else None


def _compiles(backend: str) -> bool:
    return backend.strip().upper() not in ("", "NO")
