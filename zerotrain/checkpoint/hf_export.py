"""Leaving zerotrain for Hugging Face: a directory `AutoModelForCausalLM.from_pretrained` loads.

config.json (the recorded config or one given), the consolidated weights and the
tokenizer files, after checking the parameter names against the model the config
builds: a clear list of missing names beats transformers' silent random init.

The tokenizer comes from the MODEL_CONFIG_DIR given, else from the `tokenizer/`
folder beside the checkpoint's tags (where `zerotrain train` saves the run's own).
A model built from a config (not loaded) records no `architectures`; the class is
then the one transformers' AutoModelForCausalLM maps the `model_type` to, so
pipelines and `from_pretrained` of the matching class load the directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from zerotrain.checkpoint.consolidate import (
    CONFIG_NAME,
    DTYPES,
    WEIGHTS_NAME,
    ProgressCallback,
    open_checkpoint_reader,
    resolve_dtype,
    stage_weights,
    staged_output,
)
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.config.byte_sizes import parse_byte_size
from zerotrain.checkpoint.reader import CheckpointReader

TOKENIZER_DIR = "tokenizer"  # beside the tags in a checkpoint folder: the run's tokenizer
# Files a Hugging Face model directory carries besides config and weights.
TOKENIZER_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "generation_config.json", "chat_template*",
    "vocab.*", "merges.txt", "*.model", "*.tiktoken", "preprocessor_config.json",
)


def _hf_config(reader: CheckpointReader, hf_config_dir: Path | None) -> dict:
    if hf_config_dir is not None:
        path = hf_config_dir / CONFIG_NAME
        if not path.is_file():
            raise CheckpointError(f"{path} not found: --hf needs a directory holding the model's {CONFIG_NAME}")
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    config = reader.meta.get("hf_config")
    if not config:
        raise CheckpointError(
            f"{reader.tag_dir} records no Hugging Face config (the model had no `.config`): "
            "pass --hf MODEL_CONFIG_DIR, a directory holding the model's config.json (and tokenizer)"
        )
    return dict(config)


def _with_architectures(config: dict) -> dict:
    """`config` with `architectures` set: as recorded, else the causal-LM class of its model_type."""
    if config.get("architectures"):
        return config
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # transformers not installed: nothing to name
        return config
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    return {**config, "architectures": [name]} if name else config


def _tokenizer_dir(reader: CheckpointReader, hf_config_dir: Path | None) -> Path | None:
    """Where the tokenizer files come from: MODEL_CONFIG_DIR, else the checkpoint folder's tokenizer/."""
    if hf_config_dir is not None:
        return hf_config_dir
    for candidate in (reader.tag_dir / TOKENIZER_DIR, reader.tag_dir.parent / TOKENIZER_DIR):
        if candidate.is_dir():
            return candidate
    return None


def _config_dtype(config: dict) -> torch.dtype:
    value = config.get("dtype") or config.get("torch_dtype")
    key = str(value).removeprefix("torch.").lower()
    return DTYPES.get(key, torch.float32)


def _expected_names(config: dict) -> tuple[list[list[str]], set[str]] | None:
    """(tied name groups each needing one member, every accepted name) of the model `config` builds.

    None when transformers cannot build it here (custom code, unknown type): the check is skipped.
    """
    try:
        import transformers

        cfg = transformers.AutoConfig.for_model(**config)
        arch = (config.get("architectures") or [""])[0]
        named = getattr(transformers, arch, None) if arch.isidentifier() else None
        # Only a model class: meta.json comes from disk, and must not pick any callable of transformers.
        build = named if isinstance(named, type) and issubclass(named, transformers.PreTrainedModel) \
            else transformers.AutoModelForCausalLM.from_config
        with torch.device("meta"):  # shapes only: no memory, no init cost
            model = build(cfg)
    except Exception:  # noqa: BLE001 - any failure here only means we cannot check
        return None
    groups: dict[int, list[str]] = {}  # tied parameters are one object under several names
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    param_names = {name for group in groups.values() for name in group}
    state_names = set(model.state_dict())
    buffers = [[name] for name in sorted(state_names - param_names)]  # persistent buffers
    return list(groups.values()) + buffers, state_names


def _check_names(config: dict, present: set[str], where: Path) -> dict[str, str]:
    """Raises unless `present` is what the config's model loads; returns renames of tied aliases.

    A tied weight may be stored under any of its names; it is written under the
    name transformers itself saves (the first), which other tools also expect.
    """
    expected = _expected_names(config)
    if expected is None:
        return {}
    groups, accepted = expected
    missing = sorted(g[0] for g in groups if not present.intersection(g))
    unexpected = sorted(present - accepted)
    if missing or unexpected:
        model_type = config.get("model_type", "?")
        parts = [f"{len(missing)} missing: {', '.join(missing[:10])}" if missing else "",
                 f"{len(unexpected)} not in the model: {', '.join(unexpected[:10])}" if unexpected else ""]
        raise CheckpointError(
            f"{where}: the parameter names do not match the {model_type!r} model of the config "
            f"({'; '.join(p for p in parts if p)}). Is the config the trained model's, and was the "
            "model trained unwrapped (names without a prefix)?"
        )
    rename = {}
    for group in groups:
        stored = [name for name in group if name in present]
        if len(stored) == 1 and stored[0] != group[0]:
            rename[stored[0]] = group[0]
    return rename


def export_hf(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    tag: str | None = None,
    hf_config_dir: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    progress: ProgressCallback | None = None,
) -> list[Path]:
    """Writes a directory `transformers.AutoModelForCausalLM.from_pretrained` loads; returns the files written.

    config.json comes from `hf_config_dir` when given, else from the config the
    checkpoint recorded; tokenizer and generation files are copied from
    `hf_config_dir`, else from the `tokenizer/` folder beside the checkpoint's tags.
    `dtype` defaults to the config's dtype (fp32 if unset), and config.json records
    the dtype written. Parameter names are checked against
    the model the config builds before anything is written, and a tied weight is
    written under the name transformers saves it by (e.g. model.embed_tokens.weight).
    """
    output_dir = Path(output_dir)
    config_dir = Path(hf_config_dir) if hf_config_dir else None
    with open_checkpoint_reader(checkpoint_dir, tag) as reader:
        config = _with_architectures(_hf_config(reader, config_dir))
        tokenizer_dir = _tokenizer_dir(reader, config_dir)
        out_dtype = resolve_dtype(dtype) if dtype is not None else _config_dtype(config)
        rename = _check_names(config, set(reader.params) | set(reader.module_entries), reader.tag_dir)
        # Weights, config and tokenizer appear together (see staged_output): a killed export leaves no
        # folder, or one without config.json, never a config beside half the weights.
        with staged_output(output_dir, WEIGHTS_NAME) as stage:
            names = stage_weights(reader, stage, WEIGHTS_NAME, out_dtype, parse_byte_size(max_shard_size), progress, rename)
            dtype_name = str(out_dtype).removeprefix("torch.")
            config["dtype"] = dtype_name  # what from_pretrained(dtype="auto") will load as
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype_name
            (stage / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            copied = []
            if tokenizer_dir is not None:
                sources = {p for pattern in TOKENIZER_PATTERNS for p in tokenizer_dir.glob(pattern) if p.is_file()}
                for source in sorted(sources):
                    if source.name != CONFIG_NAME:
                        shutil.copyfile(source, stage / source.name)
                        copied.append(source.name)
    return [output_dir / name for name in [CONFIG_NAME, *names, *copied]]
