"""The speed check's compiled and micro-batch-2 columns (benchmarks/gpu/speed_variants.py) and their targets
(speed_targets.py), without running an engine."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "gpu"))
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from speed_targets import targets  # noqa: E402
from speed_variants import FirstStepClock, Variant, column_micro_batch, parse_variant  # noqa: E402


def test_a_column_name_says_its_engine_compile_and_micro_batch():
    assert parse_variant("zerotrain-3-compile-mb2") == Variant("zerotrain-3", True, 2)
    assert parse_variant("fsdp2-compile") == Variant("fsdp2", True, None)
    assert parse_variant("deepspeed-2-offload") == Variant("deepspeed-2-offload", False, None)
    assert column_micro_batch("zerotrain-0-mb2", 8) == 2 and column_micro_batch("zerotrain-0-compile", 8) == 8


def test_compile_time_is_the_first_step_less_a_median_one():
    clock = FirstStepClock(sync=lambda: None)

    class Trainer:
        forward = backward = step = staticmethod(lambda *a: None)

    trainer = Trainer()
    clock.wrap(trainer)
    trainer.forward(1)
    trainer.backward(2)
    assert clock.compile_s(0.1) is None  # no whole first step yet
    trainer.step()
    clock.first_s = {"forward": 3.0, "backward": 2.0, "step": 0.5}
    assert clock.compile_s(0.5) == 5.0


def _row(tokens, step_ms=100.0, mfu=None, idle=None):
    return {"ok": True, "tokens_per_s": tokens, "step_ms": step_ms, "mfu": mfu, "gpu_idle_share": idle,
            "gpu_idle_ms": (idle or 0) * step_ms, "profiled_step_ms": step_ms}


def test_the_compiled_and_micro_batch_2_targets_judge_at_least_and_at_most():
    rows = {"zerotrain-3-compile": {"off": _row(1300, mfu=0.44)}, "deepspeed-3-compile": {"off": _row(1000)},
            "fsdp2-compile": {"off": _row(1350)},
            "zerotrain-3-compile-mb2": {"off": _row(500, step_ms=104, idle=0.12)},
            "zerotrain-0-compile-mb2": {"off": _row(520, step_ms=100)}}
    verdicts = {t["target"]: t["verdict"] for t in targets(rows, ["off"], "no peak")}
    assert verdicts == {
        "zerotrain-3-compile MFU >= 43% (checkpointing off)": "met",
        "zerotrain-3-compile tokens/s >= 1.3x DeepSpeed-3 + engine.compile() (checkpointing off)": "met",
        "zerotrain-3-compile tokens/s >= FSDP2 + per-block compile (checkpointing off)": "NOT met",
        "zerotrain-3-compile-mb2 GPU idle <= 10% of the step (checkpointing off)": "NOT met",
        "zerotrain-3-compile-mb2 step <= 1.05x zerotrain-0-compile-mb2's (checkpointing off)": "met",
    }
