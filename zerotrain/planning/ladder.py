"""The ladder: every ZeRO configuration a plan may pick, fastest first.

The guides' manual procedure (batch 1 + gradient checkpointing, stage 2, stage 2 + optimizer
offload, stage 3, parameter offload, optimizer offload, ..., NVMe) is a walk down this list:
each rung keeps less on the GPU than the one before and costs more time. A `Rung` is one
point of that walk: a ZeRO stage, where the optimizer's shard and the parameters' shard live,
and which activations are recomputed. Within one memory rung, running without gradient
checkpointing comes first, then selective checkpointing (keeps matmul and attention outputs,
recomputes the cheap ops: little time, about half the activation memory), then whole layers
(recomputing a forward costs about a third of a step); offloading the optimizer to the CPU
costs more on any model that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
CHECKPOINTING = (False, "selective", True)
"""Recomputation, least first: none, selective (matmul and attention outputs kept), whole layers."""


@dataclass(frozen=True)
class Rung:
    """One ZeRO configuration: stage, offload devices and activation recomputation."""

    stage: int
    """ZeRO stage, 0-3."""
    offload_optimizer: str = "none"
    """Where the fp32 master and optimizer state live: "none" (the GPU), "cpu" or "nvme"."""
    offload_param: str = "none"
    """Where stage 3's parameter shards live between uses: "none", "cpu" or "nvme"."""
    gradient_checkpointing: bool | str = False
    """Recompute activations in backward: False (keep all), "selective" (keep each layer's matmul and
    attention outputs, recompute the rest) or True (keep only each layer's input)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {self.stage}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(f"{name} must be one of {OFFLOAD_DEVICES}, got {getattr(self, name)!r}")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1-3")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError("offload_param needs ZeRO stage 3")
        if self.gradient_checkpointing not in CHECKPOINTING:
            raise ValueError(f"gradient_checkpointing must be one of {CHECKPOINTING}, got {self.gradient_checkpointing!r}")

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    @property
    def name(self) -> str:
        """Short words for tables: "stage 3 + optimizer cpu + params cpu + checkpointing"."""
        parts = [f"stage {self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer {self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params {self.offload_param}")
        if self.gradient_checkpointing == "selective":
            parts.append("selective checkpointing")
        elif self.gradient_checkpointing:
            parts.append("checkpointing")
        return " + ".join(parts)

    def zero_optimization(self, nvme_path: str | None = None) -> dict[str, Any]:
        """This rung as a DeepSpeed `zero_optimization` section (offload sections only when used)."""
        section: dict[str, Any] = {"stage": self.stage}
        for key, device in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if device == "none":
                continue
            entry: dict[str, Any] = {"device": device, "pin_memory": True}
            if device == "nvme":
                entry["nvme_path"] = nvme_path or "/local_nvme"
            section[key] = entry
        return section


def train_config_rung(cfg: Any) -> Rung:
    """The rung a zerotrain train config runs: its DeepSpeed section's stage and offloads, its
    training.gradient_checkpointing (an activation_checkpointing section: whole layers)."""
    zero = cfg.zero_dict().get("zero_optimization") or {}
    device = lambda key: (zero.get(key) or {}).get("device") or "none"  # noqa: E731
    ckpt = cfg.training.gradient_checkpointing or "activation_checkpointing" in cfg.zero_dict()
    return Rung(int(zero.get("stage", 0)), device("offload_optimizer"), device("offload_param"), ckpt)


# Memory rungs in the guides' speed order: stage 0 (plain data parallel) is fastest, each later
# one trades speed for GPU memory. Stage 1 offload is left out: stage 2 with the same offload
# keeps less and runs as fast.
_MEMORY_RUNGS = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (3, "nvme", "cpu"),
    (3, "nvme", "nvme"),
)


def ladder(allow_nvme: bool = True, checkpointing: bool | None = None) -> Iterator[Rung]:
    """Every rung, fastest first.

    Args:
        allow_nvme: include the NVMe rungs (only when a plan has an NVMe path).
        checkpointing: None tries each memory rung without, with selective and with whole-layer
            checkpointing; True tries the two with, False only without.
    """
    choices = CHECKPOINTING if checkpointing is None else CHECKPOINTING[1:] if checkpointing else (False,)
    for stage, optimizer, param in _MEMORY_RUNGS:
        if not allow_nvme and "nvme" in (optimizer, param):
            continue
        for ckpt in choices:
            yield Rung(stage, optimizer, param, ckpt)
