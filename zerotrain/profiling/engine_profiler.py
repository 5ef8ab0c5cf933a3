"""EngineFlopsProfiler: the `flops_profiler` config section, driven by the engine's calls.

As DeepSpeed's engine does, the step numbered `profile_step` (counting optimizer steps from 0)
is profiled: its first micro-batch's forward and backward are counted (`StepFlops`), and the
report is printed (or written to `output_file`) once that step's optimizer update is done.
Rank 0 reports; every rank counts nothing outside that one micro-step.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from zerotrain.profiling.flops_report import StepTimes, format_profile
from zerotrain.profiling.step_flops import StepFlops


class EngineFlopsProfiler:
    """Hooks an engine's forward/backward/step to profile one step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.config = engine.parsed_config.flops_profiler
        self.flops: StepFlops | None = None
        self.done = False
        self.report: str | None = None
        self._marks: dict[str, float] = {}
        self._cuda = engine.device.type == "cuda"

    @property
    def _active(self) -> bool:
        return not self.done and self.engine.rank == 0 and self.engine.global_steps == self.config.profile_step

    def before_forward(self) -> None:
        if self._active and self.flops is None:
            self.flops = StepFlops(self.engine.module)
            self.flops.start()
            self._mark("forward")

    def after_forward(self) -> None:
        if self.flops is not None and "forward_end" not in self._marks:
            self._mark("forward_end")

    def before_backward(self) -> None:
        if self.flops is not None and "backward" not in self._marks:
            self.flops.backward()
            self._mark("backward")

    def after_backward(self) -> None:
        if self.flops is not None and "backward_end" not in self._marks:
            self._mark("backward_end")
            self.flops.stop()  # one micro-batch counted; the step's update is timed next

    def before_step(self) -> None:
        if self.flops is not None and self.engine.is_gradient_accumulation_boundary():
            self._mark("step")

    def after_step(self) -> None:
        if self.flops is None or "step" not in self._marks:
            return
        self._mark("step_end")
        times = StepTimes(
            forward=self._between("forward", "forward_end"),
            backward=self._between("backward", "backward_end"),
            step=self._between("step", "step_end"),
            world_size=self.engine.world_size,
            micro_batch=self.engine.train_micro_batch_size_per_gpu(),
            peak_flops=self._peak_flops(),
        )
        cfg = self.config
        self.report = format_profile(self.flops, times, cfg.profile_step, cfg.module_depth, cfg.top_modules,
                                     cfg.detailed)
        if cfg.output_file:
            path = Path(cfg.output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.report)
        else:
            print(self.report, end="", flush=True)
        self.done, self.flops = True, None

    def _mark(self, name: str) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.engine.device)  # phase boundaries only, a few per profiled step
        self._marks[name] = time.perf_counter()

    def _between(self, start: str, end: str) -> float:
        return max(self._marks[end] - self._marks[start], 1e-9)

    def _peak_flops(self) -> float | None:
        from zerotrain.profiling.device_peaks import peak_tflops

        tflops = peak_tflops(self.engine.device, self.engine.parsed_config.compute_dtype)
        return tflops * 1e12 if tflops else None
