"""What `zerotrain train RUN.yaml` would run on this machine, for `estimate`/`plan` of the same YAML.

A plan of a train YAML describes the job `zerotrain train` starts from it, not a default one: the
processes train starts here (train's own count: every GPU, else 2 CPU ranks) and the precision it
resolves (`training.precision: auto` is bf16 on a bf16 GPU, fp32 on a CPU). Both come from train's
code, imported, so the two cannot drift. Explicit flags (--gpus, --gpus-per-node, --nodes, --dtype)
still win; what was taken from train is printed on one "assumed:" line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AssumedTrainRun:
    """The ranks and dtype `zerotrain train` would use, and where each came from."""

    processes: int
    """Processes on this machine (train's local count)."""
    on_gpu: bool
    dtype: str
    """"bf16", "fp16" or "fp32": training.precision as train resolves it here."""
    precision_setting: str
    """training.precision as the YAML gives it ("auto", "bf16", ...)."""

    def describe(self, *, ranks: bool, dtype: bool) -> list[str]:
        """What was taken from train, for the "assumed: ..." line: the ranks, the dtype, or both."""
        parts = []
        if ranks:
            what = "GPU" if self.on_gpu else "CPU rank"
            parts.append(f"{self.processes} {what}{'s' if self.processes > 1 else ''} "
                         "(what `zerotrain train` starts here)")
        if dtype:
            where = "on a GPU" if self.on_gpu else "on CPU"
            why = f"precision: auto {where}" if self.precision_setting == "auto" else \
                f"precision: {self.precision_setting}"
            parts.append(f"{self.dtype} ({why})")
        return parts


def assumed_train_run(cfg) -> AssumedTrainRun:
    """`cfg` (a loaded TrainConfig) as `zerotrain train` would run it here, with no flags."""
    from zerotrain.comm.distributed import device_for
    from zerotrain.train.command import local_process_count
    from zerotrain.train.zero_fill import resolve_precision

    device_type = device_for(0).type  # the device rank 0 trains on: what the trainer resolves precision for
    precision = resolve_precision(cfg.training.precision, device_type, cfg.zero_dict())
    return AssumedTrainRun(local_process_count(), device_type == "cuda", precision, cfg.training.precision)
