"""Regional torch.compile: each unit (decoder layer) compiled in place, ZeRO's hooks outside the graph.

`Engine.compile` (DeepSpeed's signature, as Accelerate and the HF Trainer call it) and the config's
`compile.enabled` come here. Compiling the whole model would trace ZeRO-3's gather / free hooks
(they run in `nn.Module._call_impl`) and split every layer at them; `nn.Module.compile` compiles
`_call_impl` itself. Here each unit's *forward* is replaced by its compiled version, as torchtitan
compiles each block: `_call_impl` still runs the hooks eagerly around it, so the graph holds exactly
one layer's math. HF's checkpointing wrapper is that forward, so whole-layer and selective
checkpointing are traced into the graph (torch's checkpoint higher-order op). The layers share one
code object and dynamo treats their parameters as inputs, so one graph serves every layer.
The loss is compiled on its own (`compile_loss`): the model's `loss_function`, or the chunked loss's
cross-entropy (runtime/chunked_loss.py).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from zerotrain.config.compile_schema import TORCH_COMPILE_KWARGS
from zerotrain.runtime.chunked_loss import compile_chunked_loss
from zerotrain.zero.units import find_layer_units

log = logging.getLogger("zerotrain")

DEFAULT_BACKEND = "inductor"


def compile_units(model: nn.Module, backend: str, options: dict[str, Any]) -> list[nn.Module]:
    """Compiles the forward of each unit of `model` in place (the whole forward when it has no
    repeated blocks); returns the modules compiled."""
    units = find_layer_units(model) or [model]
    for unit in units:
        unit.forward = torch.compile(unit.forward, backend=backend, **options)
    return units


def compile_loss(model: nn.Module, backend: str, options: dict[str, Any]) -> int:
    """Compiles the loss of each Hugging Face model inside `model` (its `loss_function`) and the
    chunked loss's cross-entropy where that replaces it; returns how many losses were compiled (0 or 1)."""
    if compile_chunked_loss(model, lambda fn: torch.compile(fn, backend=backend, **options)):
        return 1
    # The outermost Hugging Face model computes the loss (PEFT's wrapper is not one): its loss_function
    # is a property with a setter, a plain function of tensors.
    owner = next((m for m in model.modules() if _has_loss_property(m)), None)
    if owner is None:
        return 0
    owner.loss_function = torch.compile(owner.loss_function, backend=backend, **options)
    return 1


def _has_loss_property(module: nn.Module) -> bool:
    prop = getattr(type(module), "loss_function", None)
    return isinstance(prop, property) and prop.fset is not None


def check_compile_arguments(backend: Any, compile_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The torch.compile keyword arguments to use; TypeError naming an argument torch.compile lacks.

    A `backend` inside `compile_kwargs` is dropped with a warning, as DeepSpeed does: the argument wins.
    """
    options = dict(compile_kwargs or {})
    if "backend" in options:
        log.warning("engine.compile: the `backend` in compile_kwargs is overridden by the backend argument (%r)",
                    backend)
        options.pop("backend")
    unknown = sorted(set(options) - set(TORCH_COMPILE_KWARGS))
    if unknown:
        raise TypeError(f"engine.compile: compile_kwargs {unknown} are not torch.compile arguments "
                        f"(it takes {', '.join(TORCH_COMPILE_KWARGS)}); remove them")
    return options


class CompileMixin:
    """DeepSpeed's `engine.compile(...)` and `engine.is_compiled` for `Engine` (an nn.Module)."""

    _compiled_with: tuple[Any, dict[str, Any]] | None = None

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` has run (DeepSpeed's property)."""
        return self._compiled_with is not None

    def compile(
        self,
        backend: Any = DEFAULT_BACKEND,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compiles each decoder layer's forward in place and the loss, ZeRO's hooks left outside.

        DeepSpeed's signature: `backend` is any torch.compile backend (a name or a callable);
        `compile_kwargs` go to torch.compile (`mode`, `dynamic`, `fullgraph`, `options`). Allowed
        before or after training started (the next forward runs compiled). A second call does
        nothing, as in DeepSpeed; with other arguments it says so. `schedule` (DeepCompile's) and
        `compiled_autograd_enabled=True` are refused: both would trace ZeRO's collectives.
        """
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...): schedules are DeepSpeed's DeepCompile passes, which "
                             "zerotrain does not have (it compiles each layer with ZeRO's hooks outside the "
                             "graph); call engine.compile() without schedule")
        if compiled_autograd_enabled:
            raise ValueError("engine.compile(compiled_autograd_enabled=True): compiled autograd would trace "
                             "zerotrain's gradient-reduction hooks into the backward graph; leave it False")
        options = check_compile_arguments(backend, compile_kwargs)
        if self._compiled_with is not None:
            if self._compiled_with != (backend, options):
                log.warning("engine.compile: already compiled with backend %r and %s; this call (backend %r, %s) "
                            "changes nothing (as in DeepSpeed): build a new engine to compile differently",
                            *self._compiled_with, backend, options)
            return
        model = self.module
        if getattr(getattr(model, "config", None), "use_cache", False):
            # A KV cache in training makes each layer's graph differ (the cache's state is guarded).
            model.config.use_cache = False
        start = _compile_seconds()
        units = compile_units(model, backend, options)
        losses = compile_loss(model, backend, options)
        self._compiled_with = (backend, options)
        if getattr(self, "rank", 0) == 0:
            _report_compile_time_after_first_step(model, start, len(units), losses, backend)


def eager_for_counting():
    """Context in which compiled layers run eager, so a FLOP counter sees every operation."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _compile_seconds() -> float:
    """Seconds dynamo and its backend have spent compiling in this process so far (its own clock)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def _report_compile_time_after_first_step(model: nn.Module, start: float, units: int, losses: int,
                                          backend: Any) -> None:
    """Logs once, at the first forward after a compiled one (whose forward and backward compiled
    everything), the compile time spent since `start`; the hook then removes itself."""
    calls = 0

    def hook(module: nn.Module, args) -> None:
        nonlocal calls
        calls += 1
        if calls < 2 or _compile_seconds() <= start:
            return  # nothing compiled yet (the first step may run eager: `zerotrain train` counts its FLOPs)
        handle.remove()
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        log.info("torch.compile (%s): %d layer%s and %d loss%s compiled in %.1f s during the first compiled step",
                 name, units, "" if units == 1 else "s", losses, "" if losses == 1 else "es",
                 _compile_seconds() - start)

    handle = model.register_forward_pre_hook(hook)
