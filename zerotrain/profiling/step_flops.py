"""StepFlops: FLOPs, parameters and forward latency per module for one training micro-step.

FLOPs are counted by torch's `FlopCounterMode` (matmuls, convolutions, fused attention on the
GPU), split three ways: the forward, the backward, and the forward that gradient checkpointing
recomputes inside backward (an op counted in backward while some module's forward is running).
Model FLOPs are forward + backward without the recompute; hardware FLOPs include it.

Fused attention that the counter has no formula for (SDPA's CPU kernel) gets the analytic term
eager attention would have been counted with: QK^T and AV, 2.b.n.s_q.s_k.d each forward, twice
that backward, causal or not. The modules where that happened are recorded so the report says so.

Forward latency per module comes from module hooks: CUDA events recorded on the stream and read
once after the step (no synchronisation per module), or `time.perf_counter` on a CPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

PHASES = ("forward", "backward", "recompute")

_aten = torch.ops.aten


def _attention_forward(query, key, value, *args, out_val=None, **kwargs) -> int:
    b, n, s_q, d = query
    s_k = key[-2]
    return 2 * (2 * b * n * s_q * s_k * d)  # QK^T and AV


def _attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return 2 * _attention_forward(query, key, value)


# Kernels FlopCounterMode counts nothing for, with the eager-equivalent formula.
_ANALYTIC = {}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _attention_forward),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward)):
    if hasattr(_aten, _name):
        _ANALYTIC[getattr(_aten, _name)] = _fn


class _PhasedCounter(FlopCounterMode):
    """FlopCounterMode that also files every count under the current phase and module."""

    def __init__(self, owner: "StepFlops") -> None:
        super().__init__(display=False, custom_mapping=dict(_ANALYTIC))
        self.owner = owner

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            phase = self.owner.phase
            if phase == "backward" and self.owner.forwards_running:
                phase = "recompute"
            for parent in set(self.mod_tracker.parents):
                name = _module_name(parent)
                self.owner.flops[phase][name] += flops
                if func_packet in _ANALYTIC:
                    self.owner.analytic_modules.add(name)
        return out


class StepFlops:
    """Counts one micro-step of `model`: `start()` before its forward, `backward()` before its
    backward, `stop()` after it; then read `flops`, `latency`, `params`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.phase = "forward"
        self.forwards_running = 0
        self.flops: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PHASES}
        self.analytic_modules: set[str] = set()
        self.latency: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []
        self._open: dict[int, list] = defaultdict(list)
        self._counter: _PhasedCounter | None = None
        self._hooks: list = []
        self._cuda = next((p.device.type == "cuda" for p in model.parameters()), False)
        self.root = type(model).__name__
        self.names = {m: self._qualified(n) for n, m in model.named_modules()}

    def _qualified(self, name: str) -> str:
        return f"{self.root}.{name}" if name else self.root

    def start(self) -> None:
        for module, name in self.names.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre(name)))
            # always_call: checkpointing stops a recompute early by raising inside forwards.
            self._hooks.append(module.register_forward_hook(self._post(name), always_call=True))
        self._counter = _PhasedCounter(self)
        self._counter.__enter__()

    def backward(self) -> None:
        self.phase = "backward"

    def stop(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._cuda:
            torch.cuda.synchronize()  # once, after the step: the events are read now
            for name, begin, end in self._events:
                self.latency[name] += begin.elapsed_time(end) / 1000.0
        self._events.clear()

    def _pre(self, name: str):
        def hook(module, args):
            self.forwards_running += 1
            if self.phase == "forward":
                self._open[id(module)].append(self._now())
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            self.forwards_running -= 1
            if self.phase == "forward" and self._open[id(module)]:
                begin, end = self._open[id(module)].pop(), self._now()
                if self._cuda:
                    self._events.append((name, begin, end))
                else:
                    self.latency[name] += end - begin
        return hook

    def _now(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # --- results ----------------------------------------------------------------------------

    def module_flops(self, name: str, phase: str) -> int:
        return self.flops[phase].get(name, 0)

    def total(self, phase: str) -> int:
        return self.flops[phase].get("Global", 0)

    @property
    def model_flops(self) -> int:
        """Forward + backward: what the model needs, checkpointing or not."""
        return self.total("forward") + self.total("backward")

    @property
    def hardware_flops(self) -> int:
        """What the device ran: the model FLOPs and the recomputed forward."""
        return self.model_flops + self.total("recompute")

    def params(self, module: nn.Module) -> int:
        """Parameters of `module`, counted whole at ZeRO-3 (`ds_numel`) and once if tied."""
        seen = {id(p): getattr(p, "ds_numel", p.numel()) for p in module.parameters()}
        return sum(seen.values())


def _module_name(parent: str) -> str:
    return parent[: -len(" (backward)")] if parent.endswith(" (backward)") else parent
