"""Build a torch optimizer from a DeepSpeed-style ``"optimizer"`` config section.

DeepSpeed's names and their meaning here:

* ``Adam``  - decoupled weight decay (torch AdamW) unless ``adam_w_mode`` is false, then L2-style
  torch Adam. This is DeepSpeed's FusedAdam behaviour, where ``adam_w_mode`` defaults to true.
* ``AdamW`` - always decoupled weight decay, whatever ``adam_w_mode`` says.
* ``SGD``, ``Adagrad`` - the torch optimizers.
* ``Lamb`` - `zerotrain.optim.lamb.Lamb` (FusedLamb semantics).
* ``Lion`` - `zerotrain.optim.lion.Lion`.

DeepSpeed's FusedAdam defaults ``weight_decay`` to 0 where torch's AdamW uses 0.01; configs that
leave it out get 0, as under DeepSpeed.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zerotrain.config.errors import ConfigError
from zerotrain.optim.fused_kernels import takes_fused_adam
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.lion import Lion

# DeepSpeed-only switches each optimizer family understands besides its constructor arguments.
# set_grad_none belongs to DeepSpeed's fused kernels; zeroing grads is the engine's job here.
_ADAM_EXTRA_KEYS = ("adam_w_mode", "bias_correction", "torch_adam", "set_grad_none")
_LION_EXTRA_KEYS = ("set_grad_none",)
# DeepSpeed's FusedLion default; the Lion class itself uses the paper's (0.9, 0.99).
_DEEPSPEED_LION_BETAS = (0.9, 0.999)


def _constructor_keys(cls: type) -> tuple[str, ...]:
    """Keyword arguments of an optimizer's constructor, minus ``self`` and ``params``."""
    names = inspect.signature(cls.__init__).parameters
    return tuple(n for n in names if n not in ("self", "params"))


def _closest(name: str, candidates: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def _as_tuple_betas(options: dict[str, Any]) -> None:
    # JSON gives lists; torch and the schedules treat betas as a tuple.
    if "betas" in options and isinstance(options["betas"], list):
        options["betas"] = tuple(options["betas"])


def _normalise_groups(param_groups: Iterable[Any]) -> list[dict[str, Any]]:
    """Accept torch-style group dicts, or a bare iterable of tensors as a single group."""
    groups = list(param_groups)
    if not groups:
        raise ConfigError("build_optimizer got no parameters to optimize")
    if isinstance(groups[0], torch.Tensor):
        return [{"params": groups}]
    out = []
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigError(f"parameter group {index} must be a dict with a 'params' entry")
        group = dict(group)
        _as_tuple_betas(group)
        out.append(group)
    return out


def _build_adam(name: str, options: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    adam_w_mode = options.pop("adam_w_mode", True)
    bias_correction = options.pop("bias_correction", True)
    torch_adam = options.pop("torch_adam", False)
    options.pop("set_grad_none", None)
    if bias_correction is not True:
        raise ConfigError(
            f"optimizer {name}: bias_correction={bias_correction!r} is not supported; torch's "
            "Adam/AdamW always apply bias correction (remove the key or set it to true)"
        )
    decoupled = name == "AdamW" or bool(adam_w_mode)
    if not torch_adam:
        # FusedAdam's default, not torch AdamW's 0.01. DeepSpeed's torch_adam path keeps torch's.
        options.setdefault("weight_decay", 0.0)
    if "foreach" not in options and "fused" not in options and takes_fused_adam(p for g in groups for p in g["params"]):
        # fp32 masters on the CPU (offload, CPU runs) or CUDA: torch's fused kernel. On the CPU it
        # measured 5x foreach's speed on 2 cores, with no temporary of the shard; on an H100 3.7x
        # (fused_kernels.py); and it skips an fp16 step on the device.
        options["fused"] = True
    if not options.get("fused"):
        options.setdefault("foreach", True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(groups, **options)


def _build_lion(name: str, options: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    options.pop("set_grad_none", None)
    options.setdefault("betas", _DEEPSPEED_LION_BETAS)
    return Lion(groups, **options)


def _build_plain(cls: type) -> Callable[[str, dict[str, Any], list[dict[str, Any]]], torch.optim.Optimizer]:
    def build(name: str, options: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return cls(groups, **options)

    return build


# lower-case name -> (display name, accepted keys, builder)
_OPTIMIZERS: dict[str, tuple[str, tuple[str, ...], Callable[..., torch.optim.Optimizer]]] = {
    "adam": ("Adam", _constructor_keys(torch.optim.AdamW) + _ADAM_EXTRA_KEYS, _build_adam),
    "adamw": ("AdamW", _constructor_keys(torch.optim.AdamW) + _ADAM_EXTRA_KEYS, _build_adam),
    "sgd": ("SGD", _constructor_keys(torch.optim.SGD), _build_plain(torch.optim.SGD)),
    "adagrad": ("Adagrad", _constructor_keys(torch.optim.Adagrad), _build_plain(torch.optim.Adagrad)),
    "lamb": ("Lamb", _constructor_keys(Lamb), _build_plain(Lamb)),
    "lion": ("Lion", _constructor_keys(Lion) + _LION_EXTRA_KEYS, _build_lion),
}

SUPPORTED_OPTIMIZERS: tuple[str, ...] = tuple(entry[0] for entry in _OPTIMIZERS.values())


def build_optimizer(
    type_name: str,
    params: Mapping[str, Any] | None,
    param_groups: Iterable[dict[str, Any]] | Iterable[torch.Tensor],
) -> torch.optim.Optimizer:
    """Create the optimizer a DeepSpeed ``{"type": ..., "params": {...}}`` section describes.

    Args:
        type_name: optimizer name, case-insensitive (Adam, AdamW, SGD, Adagrad, Lamb, Lion).
        params: the section's ``params``, with DeepSpeed's key names. They become the
            optimizer's defaults.
        param_groups: torch-style group dicts (``{"params": [...], "weight_decay": 0.0}``);
            values set on a group override ``params`` for that group. A plain iterable of
            tensors is taken as one group.

    Raises:
        ConfigError: unknown type, unknown or unsupported parameter.
    """
    entry = _OPTIMIZERS.get(str(type_name).lower())
    if entry is None:
        hint = _closest(str(type_name).lower(), _OPTIMIZERS)
        did_you_mean = f" (did you mean {_OPTIMIZERS[hint][0]!r}?)" if hint else ""
        raise ConfigError(
            f"unknown optimizer type {type_name!r}{did_you_mean}; supported: {', '.join(SUPPORTED_OPTIMIZERS)}"
        )
    name, accepted, builder = entry
    options = dict(params or {})
    if "max_grad_norm" in options:
        raise ConfigError(
            f"optimizer {name}: 'max_grad_norm' is not an optimizer parameter; clip gradients with "
            "the top-level \"gradient_clipping\" setting instead"
        )
    for key in options:
        if key not in accepted:
            hint = _closest(key, accepted)
            did_you_mean = f"; did you mean {hint!r}?" if hint else ""
            raise ConfigError(
                f"optimizer {name}: unknown parameter {key!r}{did_you_mean} "
                f"(accepted: {', '.join(sorted(accepted))})"
            )
    _as_tuple_betas(options)
    return builder(name, options, _normalise_groups(param_groups))
