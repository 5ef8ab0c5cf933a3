"""One adapter per engine under test: build it around the model, then forward / backward / step.

Each `build_*` takes the freshly built fp32 model (on the CPU) and returns a
`Trainer` whose three calls are exactly what a user of that engine writes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from workload import ds_config, optimizer_kwargs

# Names are "<family>[-<stage>][-offload][-cpuadam]":
#   -offload  zero_optimization.offload_optimizer {device: cpu}, and at stage 3 also offload_param {device: cpu}
#   -cpuadam  DeepSpeed only: its own DeepSpeedCPUAdam (a JIT-built C++ op) instead of torch.optim.AdamW,
#             i.e. what a DeepSpeed user gets by default with offload; a reference, not the like-for-like column
ENGINES = [
    "ddp", "zerotrain-0", "deepspeed-0", "zerotrain-1", "deepspeed-1", "zerotrain-2", "deepspeed-2", "fsdp2",
    "zerotrain-3", "deepspeed-3",
    "zerotrain-2-offload", "deepspeed-2-offload", "deepspeed-2-offload-cpuadam",
    "zerotrain-3-offload", "deepspeed-3-offload", "deepspeed-3-offload-cpuadam",
]
# Columns outside the default list: `plain` is one process with no wrapper and no process group
# (the GPU speed check's baseline, benchmarks/gpu/speed.py); with N ranks it would run N copies.
EXTRA_ENGINES = ["plain"]


@dataclass
class Trainer:
    forward: Callable[[torch.Tensor], torch.Tensor]  # batch -> loss
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    device: torch.device
    info: dict = field(default_factory=dict)
    memory_breakdown: Callable[[], dict] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """What an engine name asks for: 'deepspeed-3-offload' -> family deepspeed, stage 3, offload on."""

    family: str
    stage: int | None = None
    offload: bool = False
    cpu_adam: bool = False


def parse(name: str) -> EngineSpec:
    """The spec an engine name in ENGINES stands for (see the naming comment above ENGINES)."""
    family, *rest = name.split("-")
    stage = int(rest.pop(0)) if rest and rest[0].isdigit() else None
    return EngineSpec(family, stage, offload="offload" in rest, cpu_adam="cpuadam" in rest)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def _init_torch_dist(device: torch.device) -> None:
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _autocast(args, device: torch.device):
    if args.dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def build(name: str, model: torch.nn.Module, args) -> Trainer:
    spec = parse(name)
    builders = {"zerotrain": _zerotrain, "deepspeed": _deepspeed, "ddp": _ddp, "fsdp2": _fsdp2, "plain": _plain}
    return builders[spec.family](model, args, spec)


def _config(args, spec: EngineSpec) -> dict:
    return ds_config(args, spec.stage, offload=spec.offload, cpu_adam=spec.cpu_adam)


def _zerotrain(model, args, spec) -> Trainer:
    import zerotrain

    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=_config(args, spec))
    return Trainer(
        forward=lambda x: engine(input_ids=x, labels=x).loss,
        backward=engine.backward,
        step=engine.step,
        device=engine.device,
        info={"version": zerotrain.__version__, "backend": dist.get_backend(),
              "optimizer": type(engine.optimizer.optimizer).__name__,
              "offload": _offload_devices(engine.parsed_config.zero_optimization.offload_optimizer,
                                          engine.parsed_config.zero_optimization.offload_param)},
        memory_breakdown=engine.memory_breakdown,
    )


def _deepspeed(model, args, spec) -> Trainer:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # deepspeed.initialize sets up the process group with its accelerator's backend
    # (on CPU: ccl when oneccl_bindings_for_pytorch is installed, else gloo).
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(args, spec)
    )
    inner = getattr(optimizer, "optimizer", optimizer)
    return Trainer(
        forward=lambda x: engine(input_ids=x, labels=x).loss,
        backward=engine.backward,
        step=engine.step,
        device=engine.device,
        info={"version": deepspeed.__version__, "backend": dist.get_backend(),
              "accelerator": get_accelerator().device_name(),
              "optimizer": f"{type(optimizer).__name__}({type(inner).__name__})",
              "offload": _offload_devices(engine.zero_offload_optimizer(), engine.zero_offload_param())},
    )


def _offload_devices(optimizer_section, param_section) -> str | None:
    """'optimizer cpu, param cpu' as the engine parsed its config (None: no offload), so the report shows
    each engine really took the offload path (DeepSpeed says nothing about it at its default log level)."""
    parts = [f"{what} {str(getattr(sec, 'device', 'none')).split('.')[-1]}"
             for what, sec in (("optimizer", optimizer_section), ("param", param_section)) if sec is not None]
    parts = [p for p in parts if not p.endswith(" none")]
    return ", ".join(parts) or None


def _ddp(model, args, spec) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _device()
    _init_torch_dist(device)
    model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return _torch_trainer(ddp, args, device, {"version": torch.__version__, "backend": dist.get_backend(),
                                              "optimizer": "AdamW"})


def _plain(model, args, spec) -> Trainer:
    """The model itself, torch.optim.AdamW and clipping: what a single-GPU torch script runs."""
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model.to(device)
    return _torch_trainer(model, args, device, {"version": torch.__version__, "backend": None, "optimizer": "AdamW",
                                                "precision": "fp32 weights, torch.autocast(bf16)"
                                                if args.dtype == "bf16" else "fp32"})


def _torch_trainer(module, args, device, info: dict) -> Trainer:
    """Plain torch training of `module` (the model, or DDP around it): fp32 weights, autocast for bf16."""
    opt = torch.optim.AdamW(module.parameters(), **optimizer_kwargs(args))
    autocast = _autocast(args, device)

    def forward(x):
        with autocast():
            return module(input_ids=x, labels=x).loss

    def step():
        torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(forward, lambda loss: loss.backward(), step, device, info=info)


def _fully_shard():
    try:  # torch >= 2.6
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4-2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _fsdp2(model, args, spec) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy = _fully_shard()
    device = _device()
    _init_torch_dist(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # Full sharding, like ZeRO-3: every unit, the root included, frees its gathered parameters after
    # forward and gathers them again in backward. Left unset, torch keeps the root (embedding, final
    # norm, lm_head: 40% of this model) unsharded from forward to backward.
    kw = {"mesh": mesh, "reshard_after_forward": True}
    if args.dtype == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(device)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(args))

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(lambda x: model(input_ids=x, labels=x).loss, lambda loss: loss.backward(), step, device,
                   info={"version": torch.__version__, "backend": dist.get_backend(), "optimizer": "AdamW",
                         "sharding": "fully_shard per decoder layer + root, reshard_after_forward=True"})
