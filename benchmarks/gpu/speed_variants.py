"""The speed check's column variants: an engine of benchmarks/engines.py, compiled and/or at micro-batch 2.

A column is "<engine>[-compile][-mb2]", e.g. "zerotrain-3-compile-mb2":

* -compile, each engine the way its users compile it:
  zerotrain and DeepSpeed: `engine.compile(backend=..., compile_kwargs={})` after `initialize`
  (DeepSpeed's API, the call Accelerate makes); FSDP2 and plain torch: torchtitan's way, each
  decoder layer compiled in place (`layer.compile()`) before `fully_shard`, so a layer is one graph
  and the sharding hooks installed after it run around it.
* -mb2: the column runs at micro-batch 2 whatever the run's micro-batch is (the host-bound regime:
  small steps show the host work that a large micro-batch hides).

Compile time is what a user waits for: the first step's time (each phase between device
synchronizations) less the median step's; dynamo's own counters give the graphs it made and the
graph breaks it took, per column.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

SUFFIXES = ("compile", "mb2")
SMALL_MICRO_BATCH = 2


@dataclass(frozen=True)
class Variant:
    """What a column name asks for: the engine it wraps, compiled or not, its own micro-batch or None."""

    engine: str
    compile: bool = False
    micro_batch: int | None = None


def parse_variant(name: str) -> Variant:
    """'zerotrain-3-compile-mb2' -> Variant('zerotrain-3', compile=True, micro_batch=2)."""
    parts = name.split("-")
    tags = set()
    while parts and parts[-1] in SUFFIXES:
        tags.add(parts.pop())
    return Variant("-".join(parts), "compile" in tags, SMALL_MICRO_BATCH if "mb2" in tags else None)


def column_names(engines: list[str]) -> list[str]:
    """Every column the check can run: each engine, compiled, at micro-batch 2, and both."""
    return [e + s for e in engines for s in ("", "-compile", "-mb2", "-compile-mb2")]


def column_micro_batch(name: str, default: int) -> int:
    """The micro-batch a column runs at (its -mb2, else the run's)."""
    return parse_variant(name).micro_batch or default


def build_column(name: str, model, args):
    """The harness's Trainer for a column (benchmarks/engines.Trainer), compiled when it asks for it.

    `args.compile_backend` names torch.compile's backend (inductor on a GPU; the dry run's is cheaper).
    """
    from engines import build

    v = parse_variant(name)
    if not v.compile:
        return build(v.engine, model, args)
    family = v.engine.split("-")[0]
    if family in ("fsdp2", "plain"):
        compile_blocks(model, args.compile_backend)  # before fully_shard, as torchtitan orders it
        trainer = build(v.engine, model, args)
        trainer.info["compile"] = f"each decoder layer .compile(backend={args.compile_backend!r})"
        return trainer
    trainer = build(v.engine, model, args)
    # engines.py hands out the engine's own bound methods: step's __self__ is the engine the user holds.
    engine = trainer.step.__self__
    if not hasattr(engine, "compile"):
        raise RuntimeError(f"{type(engine).__module__}.{type(engine).__name__} has no compile(): this "
                           f"{family} cannot run the compiled column")
    engine.compile(backend=args.compile_backend, compile_kwargs={})
    trainer.info["compile"] = f"engine.compile(backend={args.compile_backend!r}, compile_kwargs={{}})"
    return trainer


def compile_blocks(model, backend: str) -> int:
    """Compiles each decoder layer of a transformers causal LM in place; returns how many."""
    layers = model.model.layers
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


@dataclass
class FirstStepClock:
    """Times the first call of each phase of a Trainer (device-synchronized), then gets out of the way."""

    sync: Callable[[], None]
    first_s: dict[str, float] = field(default_factory=dict)

    def wrap(self, trainer) -> None:
        """Replaces trainer.forward/backward/step with timed versions (a dict lookup per call after the first)."""
        for phase in ("forward", "backward", "step"):
            setattr(trainer, phase, self._timed(phase, getattr(trainer, phase)))

    def _timed(self, phase: str, fn):
        def call(*a):
            if phase in self.first_s:
                return fn(*a)
            self.sync()
            t0 = time.perf_counter()
            out = fn(*a)
            self.sync()
            self.first_s[phase] = time.perf_counter() - t0
            return out

        return call

    def compile_s(self, median_step_s: float) -> float | None:
        """First step less a median one: the compile a user waits for (None before a whole first step)."""
        if len(self.first_s) < 3:
            return None
        return max(0.0, sum(self.first_s.values()) - median_step_s)


def dynamo_counts() -> dict[str, int]:
    """dynamo's running totals: graphs compiled and graph breaks taken (this process, so far)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def counts_since(before: dict[str, int]) -> dict[str, int]:
    """dynamo_counts() less an earlier snapshot: what one column added."""
    now = dynamo_counts()
    return {k: now[k] - before.get(k, 0) for k in now}
