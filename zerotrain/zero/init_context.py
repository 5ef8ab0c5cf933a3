"""`zero.Init`: build a model whose parameters exist only as shapes until ZeRO shards them.

Inside the context every parameter a module registers is replaced, at registration,
by a parameter of the same shape on the meta device (no memory); the tensor the
module's `__init__` allocated for it is dropped at once (`torch.empty` memory is never
touched). Buffers are computed as usual, on the current device: they are small and
often derived in `__init__` (rotary `inv_freq`), where the meta device would lose them.

The context keeps a journal of the build (init_journal.py): the random ops, which draw
nothing on meta tensors, and the initializer calls (`reset_parameters()`, a Hugging Face
model's `_init_weights(module)`). `build_flat_params` (stage.py) materializes the model
one unit at a time with `Materializer`: the unit's buckets get their real buffers and
the unit's initializer calls run again, in order, each from the generator state an
eager build would have had at that call (rank 0's, so every rank computes the same
values). The model therefore starts from the weights `torch.manual_seed(s)` and an
ordinary build give, at every stage. At stage 3 the unit is sharded before the next
one exists, so a rank never holds more than its shards plus one whole unit.

Values written into deferred parameters before `initialize` (Hugging Face's ZeRO-3
`from_pretrained` loads each module inside `GatheredParameters(..., modifier_rank=0)`)
are kept as one slice per rank (deferred_values.py); materializing a unit all-gathers
them over what its initializers computed: a written value wins.

"""

from __future__ import annotations

import types
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from zerotrain.comm import distributed as zdist
from zerotrain.zero import deferred_values
from zerotrain.zero.deferred_modules import (
    ADOPTED,
    DEFERRED,
    TARGET_DEVICE,
    deferred_apply,
    install_adoption_hook,
    has_deferred_params,
)
from zerotrain.zero.deferred_values import replace_tensor
from zerotrain.zero.init_journal import InitCall, InitJournal, RandomOpRecorder, draw_as_eager
from zerotrain.zero.init_journal import initializer_names, unwrap
from zerotrain.zero.units import assign_params_to_units

_KEPT = "_zerotrain_init_values"  # small parameters' values from __init__, for modules with no initializer
_KEEP_NUMEL = 1 << 16

# Journals of models built under Init and not materialized yet, and the Init contexts open now.
_pending: dict[int, InitJournal] = {}
_open_contexts = 0
_meta_hook = None


def on_meta_parameter(module: nn.Module, name: str, param):
    """Parameter registration hook, on from the first `Init` for the rest of the process.

    While a deferred model exists, a module built outside `Init` on the meta device took that
    device from a deferred parameter (Hugging Face's ZeRO-3 `resize_token_embeddings` builds the
    new embedding "on the old one's device"). Eagerly, and under DeepSpeed's zero.Init, whose
    parameters live on a real device, it would have drawn its initial values: its initializers
    draw as on the CPU, so what is drawn next (a value head) is what it is at stage 2.
    """
    if (_pending and not _open_contexts and isinstance(param, nn.Parameter) and param.is_meta
            and DEFERRED not in module.__dict__):
        draw_as_eager(module)
    return None


class Init:
    """DeepSpeed's `zero.Init`: a model built inside is not allocated until `initialize` shards it.

        with zerotrain.zero.Init(config=ds_config):
            model = AutoModelForCausalLM.from_config(cfg)
        engine, *_ = zerotrain.initialize(model=model, config=ds_config)

    Args:
        module: DeepSpeed partitions an already built module here; ours is sharded by
            `initialize` anyway, so it is accepted and left as it is.
        config, config_dict_or_path: accepted for DeepSpeed compatibility; the stage and
            precision come from the config given to `initialize`.
        enabled: False makes the context a no-op (a normal model is built).
        dtype: floating-point dtype the deferred parameters are recorded with (frozen
            parameters are materialized in it; trainable ones are initialized in fp32, in
            their bucket, since the fp32 masters are made from them).
        **ignored_deepspeed_kwargs: `remote_device`, `pin_memory`, `data_parallel_group`, ...
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        *,
        config=None,
        config_dict_or_path=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        **ignored_deepspeed_kwargs,
    ) -> None:
        self.module = module
        self.config = config if config is not None else config_dict_or_path
        self.enabled = enabled
        self.dtype = dtype
        self.ignored = ignored_deepspeed_kwargs
        self._handles: list = []
        self._journal = InitJournal()
        self._recorder: RandomOpRecorder | None = None

    def __enter__(self) -> Init:
        global _meta_hook, _open_contexts
        if self.enabled:
            install_adoption_hook()
            if _meta_hook is None:
                _meta_hook = torch_module.register_module_parameter_registration_hook(on_meta_parameter)
            _open_contexts += 1
            self._handles = [
                torch_module.register_module_parameter_registration_hook(self._on_parameter),
                torch_module.register_module_module_registration_hook(self._on_submodule),
            ]
            self._journal.recording = True
            self._recorder = RandomOpRecorder(self._journal)
            self._recorder.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _open_contexts
        if self._recorder is not None:
            self._recorder.__exit__(*exc)
            self._recorder = None
            _open_contexts -= 1
            if self._journal.calls:
                _pending[id(self._journal)] = self._journal
        self._journal.recording = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_parameter(self, module: nn.Module, name: str, param):
        if param is None or type(param) is not nn.Parameter:
            return None  # lazy or custom parameter types are left whole
        self._mark(module)
        if param.is_meta:
            return None  # already deferred (tied weights, re-registration)
        kept = None
        if param.numel() <= _KEEP_NUMEL and not callable(getattr(module, "reset_parameters", None)):
            # e.g. `nn.Parameter(torch.ones(d))` in a module nothing else would initialize
            kept = module.__dict__.setdefault(_KEPT, {})[name] = param.detach().clone()
        dtype = self.dtype if self.dtype is not None and param.is_floating_point() else param.dtype
        deferred = nn.Parameter(param.detach().to(device="meta", dtype=dtype), requires_grad=param.requires_grad)
        deferred.__dict__.update(param.__dict__)
        if kept is not None:
            deferred.__dict__[deferred_values.INIT_VALUE] = kept  # what GatheredParameters shows before a write
        # DeepSpeed's names for a partitioned parameter's full size (Trainer counts parameters with ds_numel)
        deferred.ds_shape = deferred.shape
        deferred.ds_numel = deferred.numel()
        return deferred

    def _on_submodule(self, parent: nn.Module, name: str, child):
        if child is not None and DEFERRED in child.__dict__:
            self._mark(parent)
        return None

    def _mark(self, module: nn.Module) -> None:
        if DEFERRED not in module.__dict__:
            object.__setattr__(module, DEFERRED, self._journal)
            object.__setattr__(module, "_apply", types.MethodType(deferred_apply, module))
            # Marked at its first parameter, before its __init__ initializes it: the calls are recorded.
            for name in initializer_names(module):
                self._journal.wrap(module, name)


class Materializer:
    """Gives a deferred model real parameters, unit by unit, identical on every rank."""

    def __init__(self, model: nn.Module, units: list[nn.Module], world: int) -> None:
        self.model = model
        self.world = world
        self.device = getattr(model, TARGET_DEVICE, None) or zdist.device_for(zdist.read_launch_env().local_rank)
        self.units: list[nn.Module] = [model, *units]  # index 0: the root unit
        per_unit, root = assign_params_to_units(model, units)  # every parameter, frozen ones too
        self.owned = [root, *per_unit]
        in_layers = {id(m) for u in units for m in u.modules()}
        self.unit_modules = [_post_order(model, skip=in_layers), *[_post_order(u, skip=set()) for u in units]]
        self.names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        journals = (m.__dict__.get(DEFERRED) for m in model.modules())
        self.journals = list({id(j): j for j in journals if j is not None}.values())
        self.calls = self._calls_by_module()
        self.done: set[int] = set()
        # Parameters added to the model after it was built under Init (PEFT adapters, layers a
        # script attaches before initialize) hold values: deferred here like the others, their
        # values kept and written back (rank 0's) when their unit is materialized.
        self.real_values: dict[int, torch.Tensor] = {}
        for param in model.parameters():
            if not param.is_meta:
                self.real_values[id(param)] = param.detach().to(self.device, copy=True)
                replace_tensor(param, param.detach().to("meta"))

    def _calls_by_module(self) -> dict[int, list[tuple[int, torch.Tensor, InitCall]]]:
        """id(module) -> [(order, generator state, call)]: rank 0's states, so every rank draws alike."""
        own = [(j, i, call) for j, journal in enumerate(self.journals) for i, call in enumerate(journal.calls)]
        rank0 = not (self.world > 1 and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0
        states = [s for journal in self.journals for s in journal.call_states()] if rank0 else []
        if self.world > 1:
            counts = torch.tensor([len(own), -len(own)], dtype=torch.int64, device=self.device)
            zdist.all_reduce(counts, "init", op=torch.distributed.ReduceOp.MAX)  # every rank learns of a mismatch
            if int(counts[0]) != -int(counts[1]):
                raise RuntimeError(
                    f"zero.Init: the ranks recorded between {-int(counts[1])} and {int(counts[0])} initializer "
                    "calls while building the model: every rank must build the same model"
                )
            size = torch.get_rng_state().numel()
            stacked = torch.stack(states) if rank0 and states else torch.empty(len(own), size, dtype=torch.uint8)
            stacked = stacked.to(self.device)
            if own:
                zdist.broadcast(stacked, 0, "init")
            states = [row.clone() for row in stacked.cpu()]  # set_rng_state wants a tensor of its own
        by_module: dict[int, list] = {}
        for order, ((j, i, call), state) in enumerate(zip(own, states)):
            by_module.setdefault(id(call.module), []).append((order, state, call))
        return by_module

    def materialize(self, flat_params: list, unit: nn.Module | None) -> None:
        """Allocates the buckets' buffers on the device, then initializes `unit` (all units
        when None: stages 0-2, whose buckets span units) into them."""
        for fp in flat_params:
            for p in fp.params:
                if p.is_meta:
                    replace_tensor(p, torch.empty(0, dtype=p.dtype, device=self.device))
            fp.data = torch.zeros(fp.padded_numel, dtype=torch.float32, device=self.device)
            fp._point_params_at_data()
        indices = range(len(self.units)) if unit is None else [next(i for i, u in enumerate(self.units) if u is unit)]
        for i in indices:
            self._init_unit(i)

    def finish(self) -> None:
        """Units without trainable parameters (frozen ones), then checks and unmarks the model."""
        for i in range(len(self.units)):
            self._init_unit(i)
        left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"zero.Init: could not materialize {left[:5]}")
        for m in self.model.modules():
            unwrap(m)
            for key in (DEFERRED, TARGET_DEVICE, _KEPT, ADOPTED, "_apply"):
                m.__dict__.pop(key, None)
        for journal in self.journals:
            _pending.pop(id(journal), None)
            journal.close()
        self.calls = {}

    def _init_unit(self, i: int) -> None:
        if i in self.done:
            return
        self.done.add(i)
        fresh = {id(p) for p in self.owned[i]}
        for p in self.owned[i]:
            if p.is_meta:  # frozen, or trainable but outside the param groups: kept whole
                replace_tensor(p, torch.zeros(p.shape, dtype=p.dtype, device=self.device))
            p.__dict__.pop("_is_hf_initialized", None)  # HF's init functions would skip it
        work = _WorkTensors(fresh)
        modules = self.unit_modules[i]
        originals = {m: OrderedDict(m._parameters) for m in modules}
        # The initializers write CPU tensors, as in an eager build (the CPU generator's numbers):
        # the unit's own parameters, or stand-ins for other units' (tied weights) and stale ones.
        bound = {m: {n: work.get(p) for n, p in params.items() if p is not None} for m, params in originals.items()}
        uninitialized: list[str] = []
        calls = sorted((c for m in modules for c in self.calls.get(id(m), [])), key=lambda c: c[0])
        # Calls that write none of this unit's parameters (e.g. a head's own weight before it was
        # tied to the embedding) are skipped: they would only fill stand-ins.
        calls = [c for c in calls if _writes_any(c[2], c[2].module, fresh)]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for m in modules:
                    m._parameters.update(bound[m])
                    self._init_buffers_and_kept(m)
                for _, state, call in calls:
                    m = call.module
                    m._parameters.update({n: work.get(p) for n, p in call.params.items() if p is not None})
                    torch.set_rng_state(state)
                    call.replay()
                    m._parameters.update(bound[m])
            work.copy_back()
        finally:
            for m, params in originals.items():
                m._parameters.clear()
                m._parameters.update(params)
        written = self._write_stored_values(self.owned[i]) | self._write_real_values(self.owned[i])
        for m in modules:
            kept = m.__dict__.get(_KEPT, {})
            if id(m) not in self.calls:
                uninitialized += [self.names.get(id(p), n) for n, p in originals[m].items()
                                  if p is not None and id(p) in fresh and n not in kept and id(p) not in written]
        if uninitialized:  # zeros would train silently (a LoRA with A = B = 0 learns nothing)
            raise RuntimeError(
                f"zero.Init: {uninitialized[:5]} have no initializer (no reset_parameters(), not in a "
                f"Hugging Face model), were too large to keep from __init__ (over {_KEEP_NUMEL} elements) "
                "and got no value before initialize, so they would start as zeros. Give their module a "
                "reset_parameters(), load values into them before initialize, or build the model "
                "outside zerotrain.zero.Init"
            )

    def _write_real_values(self, params: list[nn.Parameter]) -> set[int]:
        """Parameters that were never deferred get back the values they had (rank 0's, as
        `initialize` gives a model built without Init); in the same order on every rank."""
        written: set[int] = set()
        with torch.no_grad():
            for p in params:
                value = self.real_values.pop(id(p), None)
                if value is None:
                    continue
                if self.world > 1:
                    zdist.broadcast(value, 0, "init")
                p.copy_(value)
                written.add(id(p))
        return written

    def _write_stored_values(self, params: list[nn.Parameter]) -> set[int]:
        """Values written before `initialize` (a checkpoint loaded under ZeRO-3, see
        deferred_values.py) replace what the initializers just computed. Every rank walks the
        same parameters in the same order, so the all-gathers of their slices line up."""
        written: set[int] = set()
        with torch.no_grad():
            for p in params:
                if deferred_values.has_stored_value(p):
                    p.copy_(deferred_values.gather_whole(p, p.device))
                    written.add(id(p))
                deferred_values.forget(p)
        return written

    def _init_buffers_and_kept(self, m: nn.Module) -> None:
        """Buffers left on the meta device, and values kept from `__init__` (rank 0's)."""
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=self.device)
        for name, value in m.__dict__.get(_KEPT, {}).items():
            p = m._parameters.get(name)
            if p is not None and not p.is_meta and p.shape == value.shape:
                kept = value.to(self.device)
                if self.world > 1:  # rank 0's __init__ values, as a model built whole gets
                    zdist.broadcast(kept, 0, "init")
                p.copy_(kept)


class _WorkTensors:
    """The CPU tensors a unit's initializers write: its own parameters (or CPU copies of
    them, when they live on a GPU) and throwaway stand-ins for any other parameter."""

    def __init__(self, fresh: set[int]) -> None:
        self.fresh = fresh
        self.by_param: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (param, work)

    def get(self, p: nn.Parameter) -> nn.Parameter:
        if id(p) in self.by_param:
            return self.by_param[id(p)][1]
        if id(p) in self.fresh and p.device.type == "cpu":
            work = p
        else:
            shape = p.shape if id(p) in self.fresh else getattr(p, "ds_shape", p.shape)
            work = nn.Parameter(torch.zeros(shape, dtype=p.dtype), requires_grad=p.requires_grad)
        self.by_param[id(p)] = (p, work)
        return work

    def copy_back(self) -> None:
        for p, work in self.by_param.values():
            if work is not p and id(p) in self.fresh:
                p.data.copy_(work)


def _writes_any(call, module: nn.Module, fresh: set[int]) -> bool:
    """Whether a recorded call can write one of the unit's parameters: its module's (as they
    were at the call) or its submodules'. Each call starts from its own recorded generator
    state, so skipping one changes no other."""
    own = [p for p in call.params.values() if p is not None]
    below = [p for sub in module.modules() if sub is not module for p in sub._parameters.values() if p is not None]
    return any(id(p) in fresh for p in own + below)


def _post_order(root: nn.Module, skip: set[int]) -> list[nn.Module]:
    """Modules under `root`, children before parents (as Hugging Face initializes), minus
    the subtrees in `skip` (the layer units, for the root unit)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen or id(m) in skip:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(root)
    return out
