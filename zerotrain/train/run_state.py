"""RunState: what a `zerotrain train` checkpoint carries besides the engine's state."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    """What a checkpoint carries besides the engine's state, so a resumed run continues exactly."""

    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0  # training wall time before this process started
    data: dict = field(default_factory=dict)
    # The plan the steps were taken under, so a resume that changes it can say so.
    global_batch: int = 0
    total_steps: int = 0
    schedule: dict = field(default_factory=dict)
    # This rank's FLOPs per step and the shape they were counted at. Counting runs one step under
    # FlopCounterMode, whose dispatch changes its gradients by an ulp: a resumed run that counted
    # again would leave the uninterrupted run's losses. It reuses the count where the shape holds.
    flops: dict = field(default_factory=dict)


def plan_changes(saved: dict, now: dict) -> list[str]:
    """What differs between the plan a checkpoint was saved under (`saved`, a RunState's fields) and
    this run's (`now`: global_batch, total_steps, schedule), as "what: old → new"."""
    changes = []
    labels = {"global_batch": "global batch (samples per step)", "total_steps": "total steps",
              "schedule": "learning-rate schedule"}
    for key, label in labels.items():
        old = saved.get(key)
        if old not in (None, 0, {}) and old != now[key]:
            changes.append(f"{label}: {old} → {now[key]}")
    return changes
