"""What `accelerate launch WORDS` will do with DeepSpeed, read without importing Accelerate.

`zerotrain run accelerate launch ...` checks a few settings before it hands over (the DeepSpeed
JSON Accelerate will `json.load`, a dynamo backend Accelerate's DeepSpeed launcher drops).
Importing Accelerate for that costs seconds of CPU, so this mirrors the few rules of
`accelerate/commands/launch.py` (`_validate_launch_command`) and `commands/config/config_args.py`
that decide them: which config file is read, whether the DeepSpeed launcher runs, and which
value of a setting wins (the command line over the config file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

VALUELESS_FLAGS = frozenset({
    "-h", "--help", "-q", "--quiet", "--cpu", "--multi_gpu", "--tpu", "--enable_cpu_affinity",
    "--dynamo_use_fullgraph", "--dynamo_use_dynamic", "--dynamo_use_regional_compilation",
    "--use_deepspeed", "--use_fsdp", "--use_parallelism_config", "--use_megatron_lm", "--same_network",
    "-m", "--module", "--no_python", "--tpu_cluster", "--no_tpu_cluster", "--tpu_use_sudo",
    "--downcast_bf16", "--fp8_use_autocast_during_eval", "--debug",
})
"""`accelerate launch`'s flags that take no value (Accelerate 1.x); every other option takes one.
Its parser has allow_abbrev=False, and each option also has a spelling with dashes for underscores."""

OTHER_MODES = ("--multi_gpu", "--tpu", "--tpu_cluster", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm")
"""With any of these on the command line, the config file's distributed_type is not consulted."""


@dataclass(frozen=True)
class Setting:
    """A value given to a launch, where it comes from and how it is written (for messages)."""

    value: str
    source: str
    spelling: str = "{}"
    """How the user wrote it, with {} for the value: "--deepspeed {}"."""

    def given_as(self, value: object = None) -> str:
        """The setting as the user wrote it, or with another value (a message's fix)."""
        return self.spelling.replace("{}", str(self.value if value is None else value))


@dataclass
class AccelerateLaunch:
    """The parts of an `accelerate launch` command line that zerotrain checks."""

    options: dict[str, str | None] = field(default_factory=dict)
    """Accelerate's own options, by their underscore spelling; a flag's value is None."""
    script_words: list[str] = field(default_factory=list)
    """The training script and its arguments."""
    config_file: Path | None = None
    """The config file Accelerate reads (--config_file, or the default one when it exists)."""
    config: dict = field(default_factory=dict)

    @property
    def uses_deepspeed(self) -> bool:
        """Whether Accelerate starts the job with its DeepSpeed launcher (`launch_command`)."""
        if "--cpu" in self.options:
            return False
        if any(flag in self.options for flag in OTHER_MODES):
            return "--use_deepspeed" in self.options
        return str(self.config.get("distributed_type", "")).upper() == "DEEPSPEED"

    def setting(self, option: str, config_key: str, section: str) -> Setting | None:
        """`--option` from the command line, else `section.config_key` of the config file (as Accelerate
        copies a config section's keys onto its arguments: only where the command line left them)."""
        given = self.options.get(f"--{option}")
        if given is not None:
            return Setting(given, f"--{option} on the accelerate launch command line", f"--{option} {{}}")
        if not self._local_machine():
            return None
        value = (self.config.get(section) or {}).get(config_key)
        if value is None:
            return None
        return Setting(str(value), f"{section}.{config_key} in {self.config_file}",
                       f"{config_key}: {{}} under {section} in {self.config_file}")

    def _local_machine(self) -> bool:
        # Accelerate applies the config file's sections only for compute_environment LOCAL_MACHINE.
        return str(self.config.get("compute_environment", "LOCAL_MACHINE")).upper() == "LOCAL_MACHINE"


def accelerate_launch_words(words: Sequence[str]) -> list[str] | None:
    """The arguments after `accelerate launch` (or `accelerate-launch`), or None for another command."""
    name = os.path.basename(words[0]) if words else ""
    if name == "accelerate" and words[1:2] == ["launch"]:
        return list(words[2:])
    if name == "accelerate-launch":
        return list(words[1:])
    return None


def read_accelerate_launch(arguments: Sequence[str], env: Mapping[str, str]) -> AccelerateLaunch:
    """Splits `accelerate launch ARGUMENTS` into Accelerate's options and the script's words, and reads
    the config file Accelerate would read (`env` gives HF_HOME / XDG_CACHE_HOME for the default one)."""
    launch = AccelerateLaunch()
    index = 0
    while index < len(arguments):
        word = arguments[index]
        if not word.startswith("-") or word == "-":
            break
        name, has_value, value = word.partition("=")
        name = name[:2] + name[2:].replace("-", "_") if name.startswith("--") else name
        if has_value or name in VALUELESS_FLAGS:
            launch.options[name] = value if has_value else None
            index += 1
        else:
            launch.options[name] = arguments[index + 1] if index + 1 < len(arguments) else None
            index += 2
    launch.script_words = list(arguments[index:])
    launch.config_file = _config_file(launch.options, env)
    if launch.config_file is not None:
        launch.config = _read_config(launch.config_file)
    return launch


def default_config_file(env: Mapping[str, str]) -> Path:
    """Where `accelerate config` writes and `accelerate launch` looks without --config_file."""
    cache = env.get("XDG_CACHE_HOME", os.path.join("~", ".cache"))
    home = env.get("HF_HOME", os.path.join(cache, "huggingface"))
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def _config_file(options: Mapping[str, str | None], env: Mapping[str, str]) -> Path | None:
    given = options.get("--config_file")
    if given:
        return Path(given)
    default = default_config_file(env)
    return default if default.is_file() and "--cpu" not in options else None


def _read_config(path: Path) -> dict:
    """The config file as a dict; {} where Accelerate itself will report the problem."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML reads Accelerate's JSON configs too
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    if not isinstance(data, dict):
        return {}
    if "dynamo_backend" in data:  # the older layout, which Accelerate converts the same way
        backend = data.pop("dynamo_backend")
        data.setdefault("dynamo_config", {} if str(backend).upper() == "NO" else {"dynamo_backend": backend})
    return data
