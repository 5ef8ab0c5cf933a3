"""The step-time model against runs measured earlier and kept in the repository: a change to the model
that loses them fails here (docs/planning.md holds the tables; the scripts re-derive them).

- benchmarks/step_time/h100-2026-11-27/: the GPU check's speed part on one H100 (1.1B Llama, bf16,
  stages 0-3, checkpointing off and on, micro-batches 8, 4, 2) and `bench compute` there;
- benchmarks/step_time/published.json: published training runs at scale (held-out ones within 20%);
- benchmarks/step_time/cpu-2026-11-27/: 40 `zerotrain train` runs on 2 and 4 Gloo ranks here, with the
  `bench comm` and `bench compute` results they were predicted from.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

STEP_TIME = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"step_time_{name}", STEP_TIME / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def h100_rows():
    return _script("gpu_validate").rows(STEP_TIME / "h100-2026-11-27")


def test_compute_bound_h100_steps_are_predicted_within_5_percent(h100_rows):
    bound = [r for r in h100_rows if r["micro_batch"] == 8]
    assert len(bound) == 8  # stages 0-3, checkpointing off and on
    for r in bound:
        error = r["predicted_foreach_ms"] / r["measured_ms"] - 1
        assert abs(error) <= 0.05, f"stage {r['stage']} ckpt {r['checkpointing']}: {error:+.1%}"


def test_the_named_h100_optimizer_rate_is_a_fit_to_plain_torchs_foreach_step_in_the_micro_batch_8_run():
    """A fit, not a prediction: hardware_rates' H100 optimizer rate (27e9 elements/s) was read off the
    `plain` column of speed-mb8.json (torch's foreach AdamW over the 1.1B model's fp32 masters, the kernel
    the engine takes on a GPU, not the fused one `bench compute` timed). This only keeps the default
    tied to its source; the next test is the check that it predicts."""
    from zerotrain.planning.hardware_rates import named_rates

    validate = _script("gpu_validate")
    speeds = validate._by_micro_batch(STEP_TIME / "h100-2026-11-27", "speed")
    fitted = [mb for mb, speed in speeds.items() if validate.plain_optimizer_rate(speed)]
    assert fitted == [8]  # the runs at micro-batches 2 and 4 took no plain column: they are left out of the fit
    assert named_rates("h100").device.optimizer_elements_per_s == pytest.approx(
        validate.plain_optimizer_rate(speeds[8]), rel=0.02)


def test_the_fitted_h100_optimizer_rate_predicts_the_engines_optimizer_phase_in_the_runs_left_out_within_5_percent(
        h100_rows):
    """Out of sample: the engine's own optimizer phase (its step and gradient-buffer passes, the copy rates
    from each run's own `bench compute` probe) in the micro-batch 2 and 4 runs, separate processes the fit
    never saw, predicted at the fitted rate (gpu_validate.py's foreach column)."""
    held_out = [r for r in h100_rows if r["micro_batch"] in (2, 4)]
    assert len(held_out) == 6  # stages 0 and 3 at both, checkpointing off and on at micro-batch 2
    for r in held_out:
        assert r["predicted_foreach_opt_ms"] == pytest.approx(r["measured_opt_ms"], rel=0.05), r


def test_host_bound_h100_steps_are_under_predicted_and_said_to_be(h100_rows):
    """The known miss (no host-time term): small micro-batches at stage 3 leave the GPU idle, and the
    model is faster than the measurement there. If the model learns host time, update the docs."""
    r = next(r for r in h100_rows if r["micro_batch"] == 2 and r["stage"] == 3 and r["checkpointing"])
    assert r["gpu_idle_ms"] > 0.5 * r["measured_ms"] and r["predicted_foreach_ms"] < 0.8 * r["measured_ms"]
    assert "host-bound" in (STEP_TIME / "gpu_validation.md").read_text()


@pytest.fixture(scope="module")
def cpu_rows():
    """The forty recorded CPU runs, each predicted now from the probes recorded beside it."""
    from dataclasses import fields

    cpu = _script("cpu_validate")
    data = STEP_TIME / "cpu-2026-11-27"
    rows = []
    for raw in json.loads((data / "runs.json").read_text())["rows"]:
        r = cpu.Row(**{f.name: raw[f.name] for f in fields(cpu.Row)})
        probes = (data / f"compute-{cpu.MODELS[r.model].stem}-{r.ranks}.json", data / f"comm-{r.ranks}.json")
        r.predicted = cpu.predict(cpu.MODELS[r.model], r.ranks, r.rung.removesuffix(cpu.AGAIN), *probes).as_dict()
        rows.append(r)
    return rows


def test_the_forty_cpu_runs_are_predicted_as_documented(cpu_rows):
    errors = [abs(r.error) for r in cpu_rows]
    assert len(errors) == 40
    assert statistics.median(errors) <= 0.10 and max(errors) <= 0.20, (statistics.median(errors), max(errors))
    assert sum(e <= 0.15 for e in errors) >= 36


def test_the_live_checks_run_recorded_on_a_quiet_machine_is_predicted_within_12_percent_both_times(cpu_rows):
    """test_step_time_measured.py's live run (the 5M Llama, 2 Gloo ranks, stage 0) can only hold a factor
    of two on shared cores; recorded here twice on a quiet machine, each within 12% (-10.6%, +10.6%: the
    two measurements differ by 24% themselves: the resolution 2 cores allow)."""
    same = [r for r in cpu_rows if (r.model, r.ranks, r.rung.removesuffix(" (again)")) == ("5m", 2, "z0")]
    assert len(same) == 2
    assert all(abs(r.error) <= 0.12 for r in same), [r.error for r in same]


def test_published_runs_held_out_of_the_calibration_are_predicted_within_20_percent():
    """benchmarks/step_time/published.py at hardware_rates' defaults (one efficiency per device, calibrated
    on llm-foundry's rows only): every held-out run within 20% in speed terms, as docs/planning.md says."""
    published = _script("published")
    entries = json.loads((STEP_TIME / "published.json").read_text())
    cases = [c for c in map(published.prepare, entries) if not isinstance(c, str)]
    rows = published.evaluate(cases, {c.device: published.efficiency_of(c, {}) for c in cases})
    held_out = {r["id"]: r["speed_error"][0] for r in rows if r["role"] == "held-out"}
    assert len(held_out) == 9
    assert all(abs(e) <= published.MISS for e in held_out.values()), held_out
    calibration = [abs(r["speed_error"][0]) for r in rows if r["role"] == "calibration"]
    assert statistics.median(calibration) < 0.10
