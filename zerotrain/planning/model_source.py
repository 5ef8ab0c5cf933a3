"""The model a planning tool is asked about, built on the meta device: shapes, no bytes.

`zerotrain estimate MODEL` takes MODEL as one of:

- a local Hugging Face directory, or its config.json: that config as written (its vocabulary
  included); no weights are read, nothing is downloaded;
- a `zerotrain train` YAML (a `.yaml`/`.yml` file): its `model` section;
- a model shipped with zerotrain by name (`llama-3.2-1b`, `llama-2-7b`, `llama-3-70b`: their
  Hugging Face config.json files, in `model_presets/`), so the docs' examples run anywhere;
- an architecture name (`llama`, `gpt2`, ...) plus config overrides, as a `model` section takes
  them (`architecture` + `config_overrides`).

A `model` section (from a YAML or an architecture) goes through the trainer's own
`build_model`, so the model estimated is the one `zerotrain train` would build (vocabulary
from its tokenizer unless the overrides set one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.config.overrides import parse_key_values

_YAML_SUFFIXES = (".yaml", ".yml")
PRESETS_DIR = Path(__file__).parent / "model_presets"


def model_presets() -> list[str]:
    """The names of the model configs shipped with zerotrain (`zerotrain estimate llama-2-7b`)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_meta_model(source: str | os.PathLike | Mapping[str, Any] | Any,
                    overrides: Mapping[str, Any] | None = None) -> nn.Module:
    """The causal LM `source` names, built on the meta device (see the module docstring).

    `source`: a path (HF directory, config.json, train YAML), an architecture name, a `model`
    section mapping, or a `ModelSection`. `overrides`: HF config values (hidden_size, ...)
    applied over the source's (a section's `config_overrides` first, then these).
    Raises ConfigError for a missing path or an unknown architecture.
    """
    overrides = dict(overrides or {})
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        path = Path(text).expanduser()
        if not path.exists() and text in model_presets():
            path = PRESETS_DIR / f"{text}.json"
        if path.suffix in _YAML_SUFFIXES:
            return _from_train_yaml(path, overrides)
        if path.is_dir() or path.suffix == ".json":
            return _from_hf_config(path, overrides)
        if os.sep in text or path.exists() or text.startswith("."):
            raise _missing(text)
        # An architecture name is that architecture's default model, vocabulary included (a train
        # config's would come from its tokenizer; here there is none: byte-level gave 259 tokens).
        from transformers import AutoConfig

        from zerotrain.train.model_checks import check_architecture

        try:
            check_architecture(text)
        except ConfigError as error:
            import difflib

            near = difflib.get_close_matches(text, model_presets(), n=2, cutoff=0.6)
            hint = f"did you mean {' or '.join(near)} (shipped with zerotrain)? " if near else ""
            raise ConfigError(f"{error}\n{hint}MODEL may also name a model shipped with zerotrain: "
                              f"{', '.join(model_presets())}") from None
        overrides.setdefault("vocab_size", AutoConfig.for_model(text).vocab_size)
        return _from_section({"architecture": text, "config_overrides": overrides}, {})
    return _from_section(source, overrides)


def assumed_sizes(source: str, model: nn.Module, overrides: Mapping[str, Any]) -> str | None:
    """For an architecture name, the sizes taken from its defaults (the rest were given), in words."""
    from zerotrain.train.model_checks import SIZE_KEYS

    if os.sep in str(source) or Path(str(source)).suffix or Path(str(source)).exists() or source in model_presets():
        return None
    config = model.config
    taken = [f"{key} {getattr(config, key)}" for key in SIZE_KEYS
             if key not in overrides and getattr(config, key, None) is not None]
    return (f"{source}: {type(config).__name__}'s defaults for {', '.join(taken)} "
            "(--config-override KEY=VALUE to change them)") if taken else None


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total parameters, largest layer's parameters), each parameter counted once by identity.

    Identity, not `data_ptr()`: on the meta device every parameter's pointer is 0. Tied
    weights are one Parameter object, so they count once. The largest layer is DeepSpeed's
    notion: the module holding the most parameters of its own (children not included), e.g.
    the embedding of a transformer, the unit ZeRO-3 gathers whole.
    """
    total = sum(p.numel() for p in _unique(model.parameters()))
    largest = max((sum(p.numel() for p in _unique(m.parameters(recurse=False))) for m in model.modules()), default=0)
    return total, largest


def _unique(params) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _missing(path: str | Path) -> ConfigError:
    return ConfigError(
        f"{path} does not exist; MODEL is a local Hugging Face directory or config.json, a zerotrain train "
        f"YAML, a model shipped with zerotrain ({', '.join(model_presets())}), or an architecture name such "
        "as llama or gpt2"
    )


def _from_train_yaml(path: Path, overrides: dict[str, Any]) -> nn.Module:
    from zerotrain.train.config_files import load_train_config

    if not path.is_file():
        raise _missing(path)
    return _from_section(load_train_config(path).model, overrides)


def _from_hf_config(path: Path, overrides: dict[str, Any]) -> nn.Module:
    """A directory's (or a file's) config.json as written: its own vocabulary, no weights read."""
    from transformers import AutoModelForCausalLM

    from zerotrain.train.config import ModelSection
    from zerotrain.train.model import hf_config_of
    from zerotrain.train.model_checks import check_buildable, check_sizes

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise _missing(file) if not path.is_dir() else ConfigError(
            f"{path} holds no config.json: it is not a Hugging Face model directory")
    section = ModelSection(config=str(path), config_overrides=overrides)
    hf_config = hf_config_of(section)
    check_sizes(hf_config, section)
    check_buildable(hf_config, section)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def _from_section(section: Any, overrides: dict[str, Any]) -> nn.Module:
    """A `model` section built by the trainer's `build_model`, on the meta device."""
    from pydantic import ValidationError

    from zerotrain.config.errors import describe_validation_error
    from zerotrain.train.config import ModelSection
    from zerotrain.train.data import load_tokenizer
    from zerotrain.train.model import build_model

    data = section.model_dump() if isinstance(section, ModelSection) else dict(section)
    data["config_overrides"] = {**(data.get("config_overrides") or {}), **overrides}
    if data.get("path"):
        # A fine-tuning source: estimate its config.json (no weights read), as loaded.
        return _from_hf_config(Path(data["path"]).expanduser(), data["config_overrides"])
    try:
        section = ModelSection.model_validate(data)
    except ValidationError as error:
        raise ConfigError("invalid model section:\n" + describe_validation_error(error, ModelSection)) from None
    if section.config and not Path(section.config).expanduser().exists():
        raise _missing(Path(section.config).expanduser())
    tokenizer = load_tokenizer(section.tokenizer, section.path, trust_remote_code=section.trust_remote_code)
    with torch.device("meta"):
        return build_model(section, tokenizer)


def parse_config_overrides(items: list[str]) -> dict[str, Any]:
    """`["hidden_size=4096", "tie_word_embeddings=false"]` -> a dict (config/overrides.py reads the values)."""
    return parse_key_values(items, "--config-override", "hidden_size=4096")
