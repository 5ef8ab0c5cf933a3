"""The trainer's model: any `AutoModelForCausalLM`, from a local directory or built from a config.

Three ways to name it (the `model` section holds exactly one):

- `path`: a local Hugging Face directory with config.json and weights (nothing is downloaded);
- `config`: a local config.json (or a directory holding one): a freshly initialized model;
- `architecture`: a named model type (`llama`, `mistral`, `gpt2`, ...) plus `config_overrides`.

A model built from a config takes its vocabulary size from the tokenizer unless the
overrides set one. `trust_remote_code` is off unless the section turns it on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.train.model_checks import check_architecture, check_buildable, check_override_keys, check_sizes
from zerotrain.train.model_checks import unbuildable, unloadable


def build_model(section: Any, tokenizer: Any, *, zero_init: dict | None = None) -> nn.Module:
    """Builds the causal LM the `model` section names, in fp32 on the CPU.

    `zero_init`: a DeepSpeed config; when given (ZeRO stage 3) a model built from a config is
    constructed under `zerotrain.zero.Init`, so no rank ever holds it whole.
    """
    from transformers import AutoModelForCausalLM

    remote = bool(section.trust_remote_code)
    if section.path:
        path = Path(section.path).expanduser()
        check_model_directory(path, str(section.path))
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, trust_remote_code=remote, **_fp32()
            )
        except Exception as error:  # noqa: BLE001 - a bad directory fails in many ways; say which file
            raise unloadable(error, path) from error
        _check_vocab(model.config, tokenizer, "model.path")
        return model
    hf_config = config_to_build(section, tokenizer)
    if zero_init is not None:
        from zerotrain.zero import Init

        with Init(config=zero_init):
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=remote, **_fp32())
    return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=remote, **_fp32())


def config_to_build(section: Any, tokenizer: Any) -> Any:
    """The checked Hugging Face config a `model` section without `path` builds its model from:
    the vocabulary and special tokens from `tokenizer` unless config_overrides set them."""
    overrides = dict(section.config_overrides or {})
    hf_config = hf_config_of(section)
    if "vocab_size" not in overrides:
        hf_config.vocab_size = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is not None and name not in overrides:
            setattr(hf_config, name, getattr(tokenizer, name))
    _check_vocab(hf_config, tokenizer, "model.config_overrides.vocab_size")
    check_sizes(hf_config, section)
    check_buildable(hf_config, section)
    return hf_config


def parameter_shapes(section: Any, tokenizer: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every trainable parameter of the model `build_model` builds, without
    building it (on the meta device: no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = bool(section.trust_remote_code)
    if section.path:
        path = Path(section.path).expanduser()
        check_model_directory(path, str(section.path))
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=remote)
    else:
        hf_config = config_to_build(section, tokenizer)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=remote)
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def hf_config_of(section: Any) -> Any:
    """The Hugging Face config a `model` section builds from (`config` or `architecture`), with its
    config_overrides applied; ConfigError naming the source for a bad key or value."""
    build = _config_builder(section)
    try:
        check_override_keys(build, dict(section.config_overrides or {}), section)
        return build(**dict(section.config_overrides or {}))
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - transformers' config validation raises several types
        raise unbuildable(error, section) from error


def model_type_of(section: Any) -> str | None:
    """The `model_type` the `model` section builds: a directory's config.json, else the built config's."""
    if section.path:
        import json

        try:
            return json.loads((Path(section.path).expanduser() / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return None  # check_model_directory names what is wrong with the folder
    return hf_config_of(section).model_type


def check_model_config(section: Any) -> None:
    """What can be checked of a `model` section without a tokenizer or weights: the architecture
    name and the config_overrides keys. Run by `config check` and by `zerotrain train` before any
    rank starts (the ranks check it again as they build the model)."""
    if section.path:
        check_model_directory(Path(section.path).expanduser(), str(section.path))
        return
    build = _config_builder(section)
    if section.config_overrides:
        try:
            check_override_keys(build, dict(section.config_overrides), section)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - transformers' config validation raises several types
            raise unbuildable(error, section) from error


def _config_builder(section: Any) -> Callable[..., Any]:
    """`build(**overrides)` -> the section's Hugging Face config, once its source is checked."""
    from transformers import AutoConfig

    remote = bool(section.trust_remote_code)
    if section.config:
        source = Path(section.config).expanduser()
        if not source.exists():
            raise ConfigError(f"model.config: {source} does not exist; give a config.json or a directory holding one")
        return lambda **kw: AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=remote, **kw)
    check_architecture(section.architecture)
    return lambda **kw: AutoConfig.for_model(section.architecture, **kw)


def check_model_directory(path: Path, given: str) -> None:
    """ConfigError unless `path` is a local Hugging Face model directory; a Hub id says how to get one."""
    if (path / "config.json").is_file():
        return
    if not path.exists() and given.count("/") == 1 and not given.startswith((".", "/", "~")):
        raise ConfigError(
            f"model.path: {given!r} is not a folder here; it looks like a Hugging Face Hub id, and zerotrain "
            f"never downloads. Get the model first: `huggingface-cli download {given} --local-dir "
            f"models/{given.split('/')[1]}`, then set model.path to that folder"
        )
    raise ConfigError(
        f"model.path: {path} is not a Hugging Face model directory (no config.json there); "
        "point it at a directory written by save_pretrained, or use model.config / model.architecture"
    )


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position scheme takes, if its config says."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: weights decay; biases, norms and other 1-D parameters do not (as HF does)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _fp32() -> dict:
    # The fp32 master weights are made from these; transformers renamed the argument in 4.56.
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: torch.float32}


def _check_vocab(hf_config: Any, tokenizer: Any, key: str) -> None:
    vocab = getattr(hf_config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary holds {vocab}: token ids "
            f"past {vocab - 1} would index outside the embedding; use the model's own tokenizer or raise {key}"
        )
