"""Why a `model` section cannot become a model: one ConfigError naming the key or file and the fix.

transformers reports these problems as tracebacks from deep inside a config class, a weight
loader or a layer constructor, often without the file or the value to blame.  The trainer
calls these checks around each step of building the model, so `zerotrain train` ends with
one message (exit 2) instead:

- an architecture name transformers does not know, with "did you mean";
- a config whose sizes cannot build a model (sizes that are not positive, heads that do not
  divide the hidden size, key/value heads that do not divide the attention heads, anything
  transformers itself refuses), naming the config source and the values;
- a weights file in a `model.path` directory that is truncated or corrupt, naming the file.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable

import torch

from zerotrain.config.errors import ConfigError, render_value

# The sizes that decide whether a decoder builds (read through each config's attribute_map,
# so GPT-2's n_embd answers to hidden_size).
SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
)
_REASON_LIMIT = 600


def causal_lm_types() -> list[str]:
    """The model types `AutoModelForCausalLM` builds in this transformers version."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_architecture(name: str) -> None:
    """ConfigError unless `name` is a causal-LM model type transformers knows, suggesting the nearest one."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    types = causal_lm_types()
    if name in types:
        return
    examples = "a decoder model type as written in a config.json's model_type, e.g. llama, mistral, qwen2 or gpt2"
    if name in CONFIG_MAPPING_NAMES:
        raise ConfigError(
            f"model.architecture: {name!r} is a transformers model type, but not a causal language model "
            f"(AutoModelForCausalLM has no class for it); use {examples}"
        )
    nearest = difflib.get_close_matches(str(name).lower(), types, n=1, cutoff=0.6)
    hint = f"did you mean {nearest[0]!r}? (model.architecture takes {examples})" if nearest else f"use {examples}"
    raise ConfigError(f"model.architecture: {name!r} is not a model type transformers knows; {hint}")


_ABSENT = object()


def check_override_keys(build: Callable[..., Any], overrides: dict[str, Any], section: Any) -> None:
    """ConfigError for a `model.config_overrides` key the model's config does not have.

    transformers stores any keyword it does not know as a new attribute, so a typo
    (`hiden_size`) used to leave the size it meant at its default and build another model
    without a word. `build(**kwargs)` makes the config; a key is unknown when the config has no
    such setting and passing it changes nothing but that new attribute (keys transformers
    reads and folds in elsewhere, such as `rope_theta`, change more).
    """
    import inspect

    base = build()
    known = set(vars(base)) | set(getattr(base, "attribute_map", {}) or {})
    for cls in type(base).__mro__:
        if "__init__" in vars(cls):
            known |= set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    unknown = []
    for key in (k for k in overrides if k not in known):
        changed = build(**{key: overrides[key]})
        before, after = vars(base), vars(changed)
        if {k for k in before.keys() | after.keys() if before.get(k, _ABSENT) != after.get(k, _ABSENT)} == {key}:
            unknown.append(key)
    if not unknown:
        return
    source, _ = config_source(section)
    names = sorted(k for k in known if not k.startswith("_"))
    hints = []
    for key in unknown:
        nearest = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {nearest[0]!r}?)" if nearest else ""))
    raise ConfigError(
        f"model.config_overrides: {', '.join(hints)} {'is' if len(unknown) == 1 else 'are'} not a setting of "
        f"{type(base).__name__} ({source}); its sizes are {', '.join(k for k in SIZE_KEYS if k in known)}"
    )



def config_source(section: Any) -> tuple[str, str]:
    """(where the model config comes from, what to edit) for messages about a model built from a config."""
    overrides = dict(section.config_overrides or {})
    given = f" with model.config_overrides {render_value(overrides)}" if overrides else ""
    if section.config:
        return f"model.config {section.config}{given}", f"fix the values in {section.config} or in model.config_overrides"
    return f"model.architecture {section.architecture!r}{given}", "fix the values in model.config_overrides"


def unbuildable(error: BaseException, section: Any, hf_config: Any = None) -> ConfigError:
    """The ConfigError for a config transformers refused: the source, the sizes and the reason."""
    source, fix = config_source(section)
    sizes = f"; its sizes: {_sizes(hf_config)}" if hf_config is not None and _sizes(hf_config) else ""
    return ConfigError(f"{source} cannot build a model: {_reason(error)}{sizes}; {fix}")


def check_sizes(hf_config: Any, section: Any) -> None:
    """ConfigError for sizes that build a model transformers accepts but that cannot train.

    transformers checks few of these itself: a negative layer count builds an empty model, and
    key/value heads that do not divide the attention heads fail only in the first forward.
    """
    source, fix = config_source(section)
    values = _size_values(hf_config)
    problems = [f"{key}={value} must be positive" for key, value in values.items()
                if isinstance(value, int) and not isinstance(value, bool) and value <= 0]
    heads, kv_heads, hidden = (values.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if not problems and _ints(heads, kv_heads) and heads % kv_heads:
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    # An explicit head_dim decouples the heads from hidden_size; a derived one is hidden_size // heads.
    derived_head_dim = values.get("head_dim") in (None, hidden // heads if _ints(hidden, heads) else None)
    if not problems and _ints(hidden, heads) and hidden % heads and derived_head_dim:
        problems.append(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    if problems:
        raise ConfigError(f"{source} cannot build a model: {'; '.join(problems)}; {fix}")


def check_buildable(hf_config: Any, section: Any) -> None:
    """Builds the model's skeleton on the meta device (no memory, no init): a config transformers
    refuses fails here with one message, before any rank allocates or partitions weights.

    Skipped for remote code, whose constructors may not run on the meta device.
    """
    if section.trust_remote_code:
        return
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(hf_config)
    except Exception as error:  # noqa: BLE001 - whatever transformers raises, the config is at fault
        raise unbuildable(error, section, hf_config) from error


def unloadable(error: BaseException, path: Path) -> ConfigError:
    """The ConfigError for a `model.path` directory transformers could not load, naming the bad file."""
    broken = broken_weight_file(path)
    if broken is not None:
        file, reason = broken
        return ConfigError(
            f"model.path: the weights file {file} is truncated or corrupt ({reason}); copy or download it "
            f"again (an interrupted copy leaves it short), or save the model again with save_pretrained"
        )
    return ConfigError(
        f"model.path: transformers cannot load the model in {path}: {_reason(error)}; point model.path at a "
        "directory written by save_pretrained (config.json plus its weights), or train from scratch with "
        "model.config / model.architecture"
    )


def broken_weight_file(path: Path) -> tuple[Path, str] | None:
    """The first weights file in `path` that cannot be opened, and why (headers only for safetensors)."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt", device="cpu"):
                pass
        except Exception as error:  # noqa: BLE001 - safetensors has its own error types
            return file, _reason(error)
    for file in sorted(path.glob("*.bin")):
        try:
            torch.load(file, weights_only=True, map_location="meta", mmap=True)
        except Exception as error:  # noqa: BLE001 - torch raises many types for a bad archive
            return file, _reason(error)
    return None


def _size_values(hf_config: Any) -> dict[str, Any]:
    values = {}
    for key in SIZE_KEYS:
        try:
            value = getattr(hf_config, key)
        except AttributeError:
            continue
        if value is not None:
            values[key] = value
    return values


def _sizes(hf_config: Any) -> str:
    return ", ".join(f"{k}={render_value(v)}" for k, v in _size_values(hf_config).items())


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _reason(error: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()).rstrip(".")
    text = text or type(error).__name__
    return text if len(text) <= _REASON_LIMIT else text[:_REASON_LIMIT] + " ..."
