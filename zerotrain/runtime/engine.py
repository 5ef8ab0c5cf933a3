"""Engine: the training loop's three calls — forward, backward, step — DeepSpeed-style.

    loss = engine(batch)        # forward through the wrapped module
    engine.backward(loss)       # scale for accumulation and fp16; reduce gradients at the boundary
    engine.step()               # at the accumulation boundary: clip, update

Everything a ZeRO stage changes lives in `zerotrain/zero/`: which buffers are
whole or sharded (`stage.py`), how gradients are reduced (`grad_reducer.py`) and
how the optimizer steps on shards (`optimizer.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zerotrain.comm.distributed import read_launch_env
from zerotrain.comm.fault_points import fault_point
from zerotrain.runtime.compile import CompileMixin
from zerotrain.runtime.engine_accessors import DeepSpeedAccessors
from zerotrain.runtime.model_options import apply_model_options
from zerotrain.optim import build_optimizer, build_scheduler
from zerotrain.runtime.precision import DeviceLossScaler, build_loss_scaler
from zerotrain.runtime.step_settlement import StepSettlement
from zerotrain.profiling.engine_profiler import EngineFlopsProfiler
from zerotrain.comm.teardown import own_group
from zerotrain.runtime.throughput_timer import ThroughputTimer
from zerotrain.runtime.wall_clock import WallClockBreakdown
from zerotrain.sequence.enable import require_global_positions
from zerotrain.zero.grad_reducer import GradReducer
from zerotrain.zero.optimizer import ZeroOptimizer
from zerotrain.zero.param_gatherer import ParamGatherer
from zerotrain.zero.parameter_offload import ParameterOffload
from zerotrain.zero.offload_setup import nvme_state_offload, offload_plan
from zerotrain.zero.stage import StagePlan, build_flat_params

if TYPE_CHECKING:
    from zerotrain.config import ZeroTrainConfig

log = logging.getLogger("zerotrain")


class Engine(DeepSpeedAccessors, StepSettlement, CompileMixin, nn.Module):
    """Wraps a model for ZeRO data-parallel training; built by `zerotrain.initialize`.

    DeepSpeed's accessors (`train_batch_size()`, `get_lr()`, `was_step_applied()`, ...)
    come from `DeepSpeedAccessors` (engine_accessors.py).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ZeroTrainConfig,
        device: torch.device,
        param_groups: list[dict],
        client_optimizer: torch.optim.Optimizer | None = None,
        client_scheduler: Any = None,
        training_data: Dataset | None = None,
        collate_fn=None,
    ) -> None:
        super().__init__()
        self.parsed_config = config
        # DeepSpeed's engine.config: the config as a plain dict, "auto" values resolved
        # (the HF Trainer reads engine.config["zero_optimization"]["stage"]).
        self.config = config.model_dump(by_alias=True, exclude_none=True)
        self.config.update(self.config.pop("other_deepspeed_keys", {}))
        self.device = device
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = read_launch_env().local_rank
        self.module = model.to(device)
        self.sequence_groups = apply_model_options(model, config)  # leaf modules, activation offload, Ulysses
        self.plan = StagePlan(config.zero_optimization.stage)
        self.compute_dtype = config.compute_dtype
        trainable = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
        options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        zero = config.zero_optimization
        offload = offload_plan(zero, trainable, self.world_size, self.rank, self.compute_dtype)
        self.flat_params = build_flat_params(
            model,
            trainable,
            self.plan,
            zero.reduce_bucket_size,
            self.compute_dtype,
            zero.param_persistence_threshold,
            offload,
        )
        # Stage 3: parameters are gathered per unit around its forward and backward.
        self.param_gatherer = (
            ParamGatherer(
                self.flat_params, model, zero.prefetch_bucket_size, zero.max_live_parameters, zero.max_reuse_distance
            )
            if self.plan.shards_params
            else None
        )
        nvme = nvme_state_offload(self.flat_params, offload)
        self.reducer = GradReducer(
            self.flat_params,
            self.plan.stage,
            self.world_size,
            config.gradient_communication_dtype,
            config.prescale_gradients,
            config.gradient_predivide_factor,
            grad_swap=nvme.grads,
        )
        host_scaler = build_loss_scaler(config.fp16)  # its scale and counters move to the device
        self.loss_scaler = DeviceLossScaler(host_scaler, device) if host_scaler is not None else None
        self.optimizer = ZeroOptimizer(
            self.flat_params,
            options,
            self._optimizer_factory(client_optimizer),
            stage=self.plan.stage,
            clip=config.gradient_clipping,
            loss_scaler=self.loss_scaler,
            allgather_bucket_size=zero.allgather_bucket_size,
            sub_group_size=zero.sub_group_size,
            nvme=nvme.optimizer,
            nvme_grads=nvme.grads,
        )
        if self.param_gatherer is not None:  # DeepSpeed's name, used by tools that generate at ZeRO-3
            self.optimizer.parameter_offload = ParameterOffload(self.param_gatherer, model)
        self.lr_scheduler = self._make_scheduler(client_scheduler)
        self.training_dataloader = self._make_dataloader(training_data, collate_fn)

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._inside_no_sync = False
        self._client_optimizer_missing = client_optimizer is None
        self.timers = WallClockBreakdown(config.wall_clock_breakdown, device)
        self.tput_timer = ThroughputTimer(lambda: self.global_samples)  # DeepSpeed's name, for its scripts
        self.flops_profiler = EngineFlopsProfiler(self) if config.flops_profiler.enabled else None
        # Checkpoint calls meet on a Gloo group with a timeout; creating a group is itself a
        # collective, so it happens here, where every rank is, not in the first save.
        self._checkpoint_group_handle = own_group(dist.new_group(backend="gloo") if self.world_size > 1 else None)

    @property
    def _checkpoint_group(self):
        return self._checkpoint_group_handle.group

    # --- construction --------------------------------------------------------------------

    def _optimizer_factory(self, client_optimizer):
        if client_optimizer is not None:
            # Rebuild the user's optimizer over the master shards, same class and hyper-parameters; the
            # user's object shares its groups, as DeepSpeed steps that object: a scheduler left on it sets the LR.
            cls = type(client_optimizer)

            def rebuild(groups: list[dict]) -> torch.optim.Optimizer:
                inner = cls(groups, **_constructor_kwargs(cls, client_optimizer.defaults))
                client_optimizer.param_groups = inner.param_groups
                return inner

            return rebuild
        opt = self.parsed_config.optimizer
        if opt is None:
            # As DeepSpeed, an engine without an optimizer serves forward passes only (the HF
            # Trainer's evaluate()/predict() at ZeRO-3 without train()); step() says why it cannot.
            return lambda groups: torch.optim.SGD(groups, lr=0.0)
        return lambda groups: build_optimizer(opt.type, dict(opt.params), groups)

    def _make_scheduler(self, client_scheduler):
        inner = self.optimizer.optimizer
        if client_scheduler is not None:
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                # A factory gets the torch optimizer (as DeepSpeed hands it its basic optimizer):
                # torch's LR schedulers accept nothing else, e.g. HF's linear schedule callable.
                return client_scheduler(inner)
            # A scheduler built on the user's optimizer now drives the rebuilt one.
            client_scheduler.optimizer = inner
            return client_scheduler
        sched = self.parsed_config.scheduler
        if sched is None:
            return None
        return build_scheduler(sched.type, dict(sched.params), inner)

    def _make_dataloader(self, data, collate_fn) -> DataLoader | None:
        if data is None:
            return None
        groups = self.sequence_groups  # a sequence group's ranks read the same samples
        replicas, index = (groups.data_parallel_size, groups.data_parallel_rank) if groups else (self.world_size, self.rank)
        sampler = DistributedSampler(data, num_replicas=replicas, rank=index)
        return DataLoader(
            data, batch_size=self.train_micro_batch_size_per_gpu(), sampler=sampler, collate_fn=collate_fn
        )

    # --- forward / backward / step -------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self.parsed_config.fp16.enabled and self.parsed_config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), torch.float16)
        profiler = self.flops_profiler
        if profiler is not None:
            profiler.before_forward()
        with self.timers.measure("forward"):
            fault_point("forward")
            if self.sequence_groups is not None:
                require_global_positions(self.module, kwargs)
            out = self.module(*args, **kwargs)
        if profiler is not None:
            profiler.after_forward()
        return out

    def backward(
        self,
        loss: torch.Tensor,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
    ) -> torch.Tensor:
        """Backpropagates `loss`, scaled for fp16 and, with `scale_wrt_gas` (the default), divided
        by the accumulation steps. The HF Trainer divides the loss itself and passes False.
        `allreduce_gradients` and `release_loss` are DeepSpeed's and change nothing here."""
        boundary = self.is_gradient_accumulation_boundary()
        self.reducer.reduce_in_backward = self.plan.reduces_in_backward(boundary) and not self._inside_no_sync
        self.reducer.boundary = boundary
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0  # fp16: a device scalar
        if scale_wrt_gas:
            scale /= self.gradient_accumulation_steps()
        if self.flops_profiler is not None:
            self.flops_profiler.before_backward()
        with self.timers.measure("backward"):
            fault_point("backward")
            (loss * scale).backward(retain_graph=retain_graph)
        if self.flops_profiler is not None:
            self.flops_profiler.after_backward()
        return loss

    def step(self) -> None:
        """Counts a micro-step; at the accumulation boundary, updates the weights."""
        if self.flops_profiler is not None:
            self.flops_profiler.before_step()
        with self.timers.measure("step"):
            self._step()
        if self.flops_profiler is not None:
            self.flops_profiler.after_step()

    def _step(self) -> None:
        self._step_applied = False  # until this call updates the weights (was_step_applied)
        if self.is_gradient_accumulation_boundary():
            if self._client_optimizer_missing and self.parsed_config.optimizer is None:
                raise RuntimeError(
                    "no optimizer: this engine serves forward passes only; pass one to zerotrain.initialize("
                    'optimizer=...) or add an "optimizer": {"type": "AdamW", "params": {"lr": ...}} section to the config'
                )
            if self._inside_no_sync:
                raise RuntimeError("engine.step() at an accumulation boundary inside no_sync(): leave no_sync first")
            if self.reducer.unreduced:
                self.reducer.reduce_remaining()  # the boundary backward ran inside no_sync(): reduce now
            fault_point("optimizer_step")
            self._settle_step()  # the previous fp16 step's flag: long finished, read before this step
            self.optimizer.step()
            self._boundary_step_done()  # fp16: applied until settled (step_settlement.py)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.tput_timer.step_done()
            if self.rank == 0 and self.global_steps % self.parsed_config.steps_per_print == 0:
                self._print_progress()
        self.micro_steps += 1

    def _print_progress(self) -> None:
        self._settle_step()  # a log line reads numbers anyway: settle this step first
        parts = [f"step {self.global_steps}", f"lr {self.get_lr()}", f"grad norm {self.get_global_grad_norm():.4g}"]
        if self.loss_scaler is not None:
            parts += [f"loss scale {self.loss_scaler.loss_scale:g}", f"skipped {self.skipped_steps}"]
        if self.timers.enabled:
            parts.append(self.timers.report())
        log.info(" | ".join(parts))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally without reducing them (stages 0 and 1)."""
        if self.plan.stage >= 2:
            raise RuntimeError(
                f"no_sync() is not available at ZeRO stage {self.plan.stage}: stage 2 reduces gradients into "
                "shards on every backward by design. Use stage 0 or 1, or gradient_accumulation_steps."
            )
        previous, self._inside_no_sync = self._inside_no_sync, True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    # --- DeepSpeed's accessors: engine_accessors.py ------------------------------------------

    # --- checkpoints (zerotrain/checkpoint/) ----------------------------------------------

    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Saves the full training state; every rank must call it. Returns the checkpoint directory.

        The tag defaults to `global_step{N}`; SAVE_DIR gets a `latest` file naming it and a
        `zero_to_fp32.py` script, as DeepSpeed writes them. `exclude_frozen_parameters` is
        accepted for DeepSpeed's signature: frozen parameters are small next to the optimizer
        state and are kept, so any checkpoint restores the whole model.
        """
        from zerotrain.checkpoint.saver import save_checkpoint

        self._settle_step()  # the counters and the scheduler as DeepSpeed would have them

        return save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        strip_prefix: str | None = None,
    ) -> tuple[str | None, dict | None]:
        """Restores a checkpoint saved at any world size and stage; returns (load_path, client_state).
        `strip_prefix` (e.g. "module."): cut from the names of a DeepSpeed checkpoint of a wrapped model."""
        from zerotrain.checkpoint.loader import load_checkpoint

        self._settle_step()  # a pending outcome belongs to the state being replaced
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, strip_prefix)

    def save_16bit_model(
        self, save_dir, save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Writes the weights in the training dtype to one file (rank 0 writes; every rank calls).

        safetensors, unless `save_filename` ends in .bin/.pt/.pth (DeepSpeed's default is
        pytorch_model.bin): then a torch.save of the plain state dict. Returns True once saved,
        False at stage 3 without stage3_gather_16bit_weights_on_model_save, as DeepSpeed.
        See zerotrain/checkpoint/model_weights.py.
        """
        from zerotrain.checkpoint.model_weights import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename: str = "model.safetensors") -> bool:
        """DeepSpeed's older name for `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole state dict in the training dtype on rank 0 (CPU copies), None on other
        ranks; every rank must call it (DeepSpeed's name: Accelerate and the Trainer call it)."""
        from zerotrain.checkpoint.model_weights import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Removes the engine's hooks from the module (Accelerate calls it before building another)."""
        self.reducer.remove_hooks()
        if self.param_gatherer is not None:
            self.param_gatherer.remove_hooks()

    def __getattr__(self, name: str):
        # As DeepSpeed's engine: attributes it lacks are the wrapped module's (engine.generate,
        # engine.config of a model is NOT forwarded: `config` is the engine's own).
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients, master weights and optimizer state."""
        return self.optimizer.resident_bytes()


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    """The optimizer's defaults its constructor accepts (some classes store derived keys too)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _cast_floats(obj, dtype: torch.dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
