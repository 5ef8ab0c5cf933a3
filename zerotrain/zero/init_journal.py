"""The record `zero.Init` keeps of a model's initialization, so a deferred model gets the
values an eager build would have given it, bit for bit, and leaves torch's generator where
an eager build leaves it.

An eager build (`torch.manual_seed(s)`, then the model) draws every initial value from
torch's CPU generator in one stream: each module's constructor initializes its
parameters (`reset_parameters()`), then a Hugging Face model's `post_init()`
initializes them again with `_init_weights(module)`, module by module. Under `Init`
the parameters are meta tensors, and random ops on meta tensors draw nothing. So, as
the model is built, the journal:

- notes every outermost initializer call (`reset_parameters()`, `_init_weights(module)`)
  with the generator state it started from and the parameter objects the module held
  at that moment (a tied weight is re-bound later: the call wrote the module's own
  parameter, not the one it ends up sharing), then replays the call on scratch
  stand-ins for those parameters, one module at a time, so that the stream moves on by
  exactly what the eager call drew (even where that depends on the values drawn, as in
  rejection sampling, or where an initializer skips meta tensors, as `trunc_normal_`);
- runs every random op on a meta tensor outside those calls again on a scratch tensor
  of the same layout, for the same reason.

Code that draws after the build (a value head a script adds, a resized embedding)
therefore gets the numbers it gets after an eager build, as with DeepSpeed's `zero.Init`,
which initializes each parameter for real before it partitions it. Materializing a unit
(init_context.py) reruns its modules' calls, in build order, each from its noted state:
the values an eager build computes, without ever holding more than that unit.

Values a module computed outside any initializer (`nn.Parameter(torch.randn(d))` in its
`__init__`) are kept from `__init__` when small (see `init_context`). An initializer that
writes its submodules' parameters is replayed with its own parameters only (the
submodules stay meta while the model is built), so it matches only in distribution.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# Random ops by name: those whose default overload takes no `generator` (they use the default
# one) and the in-place samplers; any other op with a `generator` argument is random too.
_RANDOM_OP_NAMES = {
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
    "multinomial", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet", "native_dropout",
    "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_",
}
_RECORDED = "_zerotrain_recorded"  # on the wrappers this module installs


@dataclass(frozen=True)
class _TensorSpec:
    """What a random op needs of a tensor argument to consume the same numbers: its layout."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def scratch(self) -> torch.Tensor:
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if all(self.shape) else 0
        return torch.zeros(extent, dtype=self.dtype).as_strided(self.shape, self.stride)


@dataclass
class InitCall:
    """One outermost initializer call made while the model was built."""

    module: nn.Module  # the module whose parameters it initializes
    method: Callable[..., Any]  # the original (unwrapped) bound method
    args: tuple
    kwargs: dict
    params: dict[str, nn.Parameter]  # module._parameters at the time of the call
    state: torch.Tensor  # the CPU generator state the call started from

    def replay(self) -> None:
        self.method(*self.args, **self.kwargs)

    def run(self) -> Any:
        """Makes the call. If it met meta parameters (they draw nothing), replays it on scratch from
        its start state, so the generator moves on as the eager call on the CPU moved it."""
        result = self.method(*self.args, **self.kwargs)
        if any(p is not None and p.is_meta for p in self.params.values()):
            torch.set_rng_state(self.state)
            self.replay_on_scratch()
        return result

    def replay_on_scratch(self) -> None:
        """Runs the call on throwaway CPU tensors standing for the module's parameters, only to
        consume the generator as the eager call did (rejection sampling draws a data-dependent
        amount; `trunc_normal_` draws nothing at all on a meta tensor)."""
        saved = dict(self.module._parameters)
        try:
            for name, p in self.params.items():
                if p is not None:
                    self.module._parameters[name] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype),
                                                                 requires_grad=p.requires_grad)
            with torch.no_grad():
                self.replay()
        finally:
            self.module._parameters.clear()
            self.module._parameters.update(saved)


@dataclass
class InitJournal:
    """The initializer calls of one `Init` context, in the order they were made."""

    calls: list[InitCall] = field(default_factory=list)
    recording: bool = False
    _depth: int = 0

    # --- recording -------------------------------------------------------------------------

    def wants_op(self) -> bool:
        """Random ops inside an initializer call are consumed by replaying the call itself."""
        return self.recording and self._depth == 0

    def wrap(self, module: nn.Module, name: str) -> None:
        """Replaces `module.<name>` (an initializer) by one that records its outermost calls."""
        method = getattr(module, name, None)
        if not callable(method) or getattr(method, _RECORDED, False):
            return
        journal = self

        def recorded(*args, **kwargs):
            if not journal.recording or journal._depth:
                return method(*args, **kwargs)
            call = _call(module, name, method, args, kwargs)
            journal.calls.append(call)
            journal._depth += 1  # the call's own random ops are not recorded: replaying it consumes them
            try:
                return call.run()
            finally:
                journal._depth -= 1

        setattr(recorded, _RECORDED, True)
        object.__setattr__(module, name, recorded)

    def call_states(self) -> list[torch.Tensor]:
        """The CPU generator state at the start of each call, as an eager build had it."""
        return [call.state for call in self.calls]

    def close(self) -> None:
        """Drops the record (it holds the modules): called once the model is materialized."""
        self.calls.clear()
        self.recording = False


def _call(module: nn.Module, name: str, method: Callable[..., Any], args: tuple, kwargs: dict) -> InitCall:
    target = args[0] if name == "_init_weights" and args and isinstance(args[0], nn.Module) else module
    return InitCall(target, method, args, kwargs, dict(target._parameters), torch.get_rng_state())


def draw_as_eager(module: nn.Module) -> None:
    """Wraps the initializers of a module built on the meta device outside `Init`, so that their
    calls move the generator on as on the CPU (see `init_context.on_meta_parameter`)."""
    for name in initializer_names(module):
        method = getattr(module, name, None)
        if callable(method) and not getattr(method, _RECORDED, False):

            def drawing(*args, _name=name, _method=method, **kwargs):
                return _call(module, _name, _method, args, kwargs).run()

            setattr(drawing, _RECORDED, True)
            object.__setattr__(module, name, drawing)


class RandomOpRecorder(TorchDispatchMode):
    """While a model is built under `Init`: a random op on a meta tensor that an eager build would have
    drawn from the CPU generator runs again on a scratch tensor, so the stream moves on as eagerly."""

    def __init__(self, journal: InitJournal) -> None:
        super().__init__()
        self.journal = journal
        self._random: dict[Any, bool] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.journal.wants_op() and self._is_random(func) and _on_meta(args, kwargs) and _draws_from_cpu_default(args, kwargs):
            # Drew nothing: draw what it would have drawn on the CPU, and drop it.
            func(*tree_map(_scratch, tree_map(_spec, args)), **_on_cpu(tree_map(_scratch, tree_map(_spec, kwargs))))
        return out

    def _is_random(self, func) -> bool:
        known = self._random.get(func)
        if known is None:
            known = func.overloadpacket.__name__ in _RANDOM_OP_NAMES or any(
                "Generator" in str(a.type) for a in func._schema.arguments
            )
            self._random[func] = known
        return known


def _on_meta(args: tuple, kwargs: dict) -> bool:
    """True when the op ran on the meta device (and so drew nothing)."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "meta":
        return True
    return any(t.is_meta for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))


def _draws_from_cpu_default(args: tuple, kwargs: dict) -> bool:
    """True when the op uses the default CPU generator: no explicit generator, no CUDA tensor or device."""
    if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
        return False
    device = kwargs.get("device")
    if device is not None and torch.device(device).type not in ("cpu", "meta"):
        return False
    return all(t.device.type in ("cpu", "meta") for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
    return value


def _scratch(value: Any) -> Any:
    return value.scratch() if isinstance(value, _TensorSpec) else value


def _on_cpu(kwargs: dict) -> dict:
    # A random creation op on the meta device would have run on the CPU in an eager build.
    if "device" in kwargs and kwargs["device"] is not None and torch.device(kwargs["device"]).type == "meta":
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


def initializer_names(module: nn.Module) -> list[str]:
    """The methods of `module` whose calls initialize parameters and are worth recording."""
    names = ["reset_parameters"] if callable(getattr(module, "reset_parameters", None)) else []
    if "transformers" in sys.modules:
        from transformers import PreTrainedModel

        if isinstance(module, PreTrainedModel):
            names.append("_init_weights")  # post_init() calls it for every module of the model
    return names


def unwrap(module: nn.Module) -> None:
    """Removes the recording wrappers from `module`."""
    for name in ("reset_parameters", "_init_weights"):
        if getattr(module.__dict__.get(name), _RECORDED, False):
            del module.__dict__[name]
