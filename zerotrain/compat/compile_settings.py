"""A torch.compile (dynamo) answer on Accelerate's DeepSpeed path: passed on to the ranks and said.

Accelerate's other launchers write the dynamo settings of the command line and the config file
into the ranks' environment (ACCELERATE_DYNAMO_*, read by its TorchDynamoPlugin), but its
DeepSpeed launcher never does: the answer is dropped without a word. `zerotrain run` writes
them as the other launchers do, so the ranks' Accelerator calls
`engine.compile(backend=..., compile_kwargs=...)`, zerotrain's regional compile (each decoder
layer's forward compiled in place, ZeRO's hooks outside: zerotrain/runtime/compile.py).

Regional compilation asked for (`dynamo_use_regional_compilation`) is that same compile: it is
passed to the ranks as off, so that Accelerate calls `engine.compile` rather than its own
`compile_regions_deepspeed`, which compiles each block's whole `__call__` with ZeRO's hooks
traced into it. ACCELERATE_DYNAMO_BACKEND already in the environment reaches the ranks as it
is (Accelerate applies it); a launch that sets a backend overrides it, as Accelerate's own
launchers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from zerotrain.compat.accelerate_launch_args import AccelerateLaunch, Setting
from zerotrain.config.errors import UserInputError

ENV_PREFIX = "ACCELERATE_DYNAMO_"
DYNAMO_ENV = ENV_PREFIX + "BACKEND"
REGIONAL_ENV = ENV_PREFIX + "USE_REGIONAL_COMPILATION"

DYNAMO_BACKENDS = ("NO", "EAGER", "AOT_EAGER", "INDUCTOR", "AOT_TS_NVFUSER", "NVPRIMS_NVFUSER", "CUDAGRAPHS",
                   "OFI", "FX2TRT", "ONNXRT", "TENSORRT", "AOT_TORCHXLA_TRACE_ONCE", "TORCHXLA_TRACE_ONCE",
                   "TVM", "HPU_BACKEND", "NEURON")
"""Accelerate's DynamoBackend values (1.x; a test compares them with the installed Accelerate)."""
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune")
"""Accelerate's TORCH_DYNAMO_MODES."""

_FLAGS = {"use_fullgraph": "USE_FULLGRAPH", "use_dynamic": "USE_DYNAMIC",
          "use_regional_compilation": "USE_REGIONAL_COMPILATION"}
"""`accelerate launch --dynamo_<key>` flags (and `dynamo_<key>` in dynamo_config) -> ACCELERATE_DYNAMO_<value>."""


@dataclass(frozen=True)
class DynamoLaunch:
    """What a DeepSpeed launch compiles: the backend and where it comes from, the variables to set in
    the ranks' environment, and the settings in force (for the one line that says so)."""

    backend: Setting
    env: dict[str, str] = field(default_factory=dict)
    """ACCELERATE_DYNAMO_* to set in the job's environment (the launch's own, as Accelerate's launchers write them)."""
    options: dict[str, str] = field(default_factory=dict)
    """mode, fullgraph, dynamic as the ranks will read them."""
    regional_redirected: bool = False
    """Regional compilation was asked for: the ranks get it off, so Accelerate calls engine.compile."""

    @property
    def compiles(self) -> bool:
        return _compiles(self.backend.value)

    def announcement(self) -> str:
        """One line: what is compiled, with which settings, from where."""
        if not self.compiles:
            return f"torch.compile off (dynamo backend {self.backend.value!r}, {self.backend.source})"
        options = ", ".join(f"{key} {value}" for key, value in self.options.items())
        regional = ("; regional compilation asked for is this one, Accelerate's per-block compile is not used"
                    if self.regional_redirected else "")
        return (f"torch.compile: backend {self.backend.value.lower()!r} ({self.backend.source}; {options}), "
                f"applied by engine.compile: each decoder layer's forward compiled in place, ZeRO's hooks "
                f"outside{regional}")


def dynamo_launch(launch: AccelerateLaunch, env: Mapping[str, str]) -> DynamoLaunch | None:
    """The dynamo settings of this DeepSpeed launch, or None when it is not a DeepSpeed launch or sets none.

    Raises UserInputError for a backend or mode Accelerate would refuse on every rank.
    """
    if not launch.uses_deepspeed:
        return None
    chosen = launch.setting("dynamo_backend", "dynamo_backend", "dynamo_config")
    if chosen is None:
        return _from_environment(env)
    backend = _checked(chosen, DYNAMO_BACKENDS, str.upper, "inductor")
    mode_setting = launch.setting("dynamo_mode", "dynamo_mode", "dynamo_config")
    mode = _checked(mode_setting, DYNAMO_MODES, str.lower, "default") if mode_setting else "default"
    flags = {key: _flag(launch, key) for key in _FLAGS}
    regional = flags["use_regional_compilation"]
    flags["use_regional_compilation"] = False  # engine.compile is the regional compile (module docstring)
    variables = {DYNAMO_ENV: backend, ENV_PREFIX + "MODE": mode}
    variables.update({ENV_PREFIX + name: str(flags[key]) for key, name in _FLAGS.items()})
    options = {"mode": mode, "fullgraph": str(flags["use_fullgraph"]), "dynamic": str(flags["use_dynamic"])}
    return DynamoLaunch(chosen, variables, options, regional_redirected=regional and _compiles(backend))


def _from_environment(env: Mapping[str, str]) -> DynamoLaunch | None:
    value = env.get(DYNAMO_ENV, "")
    if not _compiles(value):
        return None
    source = Setting(value, f"{DYNAMO_ENV} in the environment", f"{DYNAMO_ENV}={{}}")
    _checked(source, DYNAMO_BACKENDS, str.upper, "inductor")
    regional = _true(env.get(REGIONAL_ENV, "False"))
    options = {"mode": env.get(ENV_PREFIX + "MODE", "default"),
               "fullgraph": str(_true(env.get(ENV_PREFIX + "USE_FULLGRAPH", "False"))),
               # unset, Accelerate leaves dynamic to torch (None: dynamic once a shape changes)
               "dynamic": str(_true(env[ENV_PREFIX + "USE_DYNAMIC"])) if ENV_PREFIX + "USE_DYNAMIC" in env else "auto"}
    return DynamoLaunch(source, {REGIONAL_ENV: "False"} if regional else {}, options, regional_redirected=regional)


def _flag(launch: AccelerateLaunch, key: str) -> bool:
    """`--dynamo_<key>` (a flag: given means on), else `dynamo_<key>` in the config file's dynamo_config."""
    if f"--dynamo_{key}" in launch.options:
        return True
    setting = launch.setting(f"dynamo_{key}", f"dynamo_{key}", "dynamo_config")
    return setting is not None and _true(setting.value)


def _checked(setting: Setting, allowed: tuple[str, ...], spelling, example: str) -> str:
    """The value as Accelerate spells it; a UserInputError before launch where every rank would refuse it."""
    value = spelling(setting.value.strip())
    if value not in allowed:
        raise UserInputError(
            f"{setting.value!r} ({setting.source}) is not one of Accelerate's choices "
            f"({', '.join(a.lower() for a in allowed)}), and every rank would stop on it: "
            f"e.g. {setting.given_as(example)}")
    return value


def _true(value: str) -> bool:
    # Accelerate's str_to_bool: y/yes/t/true/on/1 are true (its other values false or an error on the ranks).
    return str(value).strip().lower() in ("y", "yes", "t", "true", "on", "1")


def _compiles(backend: str) -> bool:
    return backend.strip().upper() not in ("", "NO")
