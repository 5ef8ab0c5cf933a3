"""The record `zero.Init` keeps of a model's initialization, so a deferred model gets the
values an eager build would have given it, bit for bit.

An eager build (`torch.manual_seed(s)`, then the model) draws every initial value from
torch's CPU generator in one stream: each module's constructor initializes its
parameters (`reset_parameters()`), then a Hugging Face model's `post_init()`
initializes them again with `_init_weights(module)`, module by module. Under `Init`
the parameters are meta tensors, and random ops on meta tensors draw nothing, so
the stream is never consumed. The journal records instead, in order:

- every outermost initializer call (`reset_parameters()`, `_init_weights(module)`),
  with the parameter objects the module held at that moment (a tied weight is re-bound
  later: the call wrote the module's own parameter, not the one it ends up sharing);
- every random op outside those calls (on meta tensors or real ones): its shapes,
  strides, dtypes and arguments, enough to consume the same numbers on a scratch tensor;
- the generator state whenever it changed behind the journal's back (`torch.manual_seed`
  inside the context).

`call_states` (rank 0, before the first unit) walks the journal: it replays the ops on
scratch tensors and each call on scratch stand-ins for its module's parameters, one at
a time (memory: one module), reading the generator state as each call starts. Replaying
whole calls, not their ops, consumes exactly what the eager call did, even where that
depends on the values drawn (rejection sampling) or where an initializer skips meta
tensors altogether (`trunc_normal_`). Materializing a unit then reruns its modules'
calls, in journal order, each from its recorded state: the values an eager build
computes, without ever holding more than that unit.

Values a module computed outside any initializer (`nn.Parameter(torch.randn(d))` in its
`__init__`) are kept from `__init__` when small (see `init_context`), drawn at a
different point of the stream than an eager build would: those match only in
distribution. An initializer that writes its submodules' parameters is replayed with
its own parameters only (the submodules stay meta while the journal is walked), so it
matches only in distribution too.
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

    def replay(self) -> None:
        self.method(*self.args, **self.kwargs)

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
            self.replay()
        finally:
            self.module._parameters.clear()
            self.module._parameters.update(saved)


@dataclass
class InitJournal:
    """Ordered events of one `Init` context: ("state", tensor), ("op", func, args, kwargs), ("call", index)."""

    events: list[tuple] = field(default_factory=list)
    calls: list[InitCall] = field(default_factory=list)
    recording: bool = False
    _depth: int = 0
    _expected_state: torch.Tensor | None = None

    # --- recording -------------------------------------------------------------------------

    def _sync_state(self) -> None:
        """Notes the generator state if it is not what the journal's own record implies (a reseed)."""
        state = torch.get_rng_state()
        if self._expected_state is None or not torch.equal(state, self._expected_state):
            self.events.append(("state", state))
            self._expected_state = state

    def wants_op(self) -> bool:
        """Random ops inside an initializer call are consumed by replaying the call itself."""
        return self.recording and self._depth == 0

    def record_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        self._sync_state()
        self.events.append(("op", func, tree_map(_spec, args), tree_map(_spec, kwargs)))

    def op_done(self) -> None:
        # A real op moved the generator; a meta one did not (that is why it is recorded).
        self._expected_state = torch.get_rng_state()

    def wrap(self, module: nn.Module, name: str) -> None:
        """Replaces `module.<name>` (an initializer) by one that records its outermost calls."""
        method = getattr(module, name, None)
        if not callable(method) or getattr(method, _RECORDED, False):
            return
        journal = self

        def recorded(*args, **kwargs):
            if not journal.recording or journal._depth:
                return method(*args, **kwargs)
            target = args[0] if name == "_init_weights" and args and isinstance(args[0], nn.Module) else module
            journal._sync_state()
            journal.events.append(("call", len(journal.calls)))
            journal.calls.append(InitCall(target, method, args, kwargs, dict(target._parameters)))
            journal._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                journal._depth -= 1
                # Whatever the call drew is accounted for by replaying it: not a reseed.
                journal._expected_state = torch.get_rng_state()

        setattr(recorded, _RECORDED, True)
        object.__setattr__(module, name, recorded)

    # --- replay ----------------------------------------------------------------------------

    def call_states(self) -> list[torch.Tensor]:
        """The CPU generator state at the start of each call, as an eager build would have had it."""
        states: list[torch.Tensor] = []
        last_call = max((i for i, e in enumerate(self.events) if e[0] == "call"), default=-1)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for event in self.events[: last_call + 1]:
                if event[0] == "state":
                    torch.set_rng_state(event[1])
                elif event[0] == "op":
                    _, func, args, kwargs = event
                    func(*tree_map(_scratch, args), **_on_cpu(tree_map(_scratch, kwargs)))  # consumed, dropped
                else:
                    states.append(torch.get_rng_state())
                    self.calls[event[1]].replay_on_scratch()
        return states

    def close(self) -> None:
        """Drops the record (it holds the modules): called once the model is materialized."""
        self.events.clear()
        self.calls.clear()
        self.recording = False


class RandomOpRecorder(TorchDispatchMode):
    """While a model is built under `Init`: every random op drawing from the CPU generator goes to the journal."""

    def __init__(self, journal: InitJournal) -> None:
        super().__init__()
        self.journal = journal
        self._random: dict[Any, bool] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = self.journal.wants_op() and self._is_random(func) and _draws_from_cpu_default(args, kwargs)
        if record:
            self.journal.record_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if record:
            self.journal.op_done()
        return out

    def _is_random(self, func) -> bool:
        known = self._random.get(func)
        if known is None:
            known = func.overloadpacket.__name__ in _RANDOM_OP_NAMES or any(
                "Generator" in str(a.type) for a in func._schema.arguments
            )
            self._random[func] = known
        return known


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
