"""The step-time model against real `zerotrain train` runs on this machine, calibrated only by
`zerotrain bench comm` and `zerotrain bench compute`: a small version of
benchmarks/step_time/cpu_validate.py (2 Gloo ranks, the ~5M Llama, stage 0, a few steps); and, by hand,
the two parts of the model those runs called for (the engine's gradient-buffer passes at the measured copy
rates, collective times read off bench comm's measurements between two measured sizes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from free_ports import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time" / "cpu_validate.py"


def _validate():
    spec = importlib.util.spec_from_file_location("step_time_cpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_a_collective_between_two_measured_sizes_is_read_off_the_measurements():
    from dataclasses import replace

    from zerotrain.planning.hardware_rates import CollectiveFit, named_rates
    from zerotrain.planning.step_time import collective_s

    # 16 MiB in 10 ms, 64 MiB in 80 ms (Gloo on 2 cores: the bandwidth halves out of the caches).
    fit = CollectiveFit(1e-3, 1.0, 2, ((16 << 20, 0.010), (64 << 20, 0.080)))
    rates = replace(named_rates("h100"), fits={"all_gather": fit})
    assert collective_s("all_gather", 40 << 20, 2, 8, rates) == pytest.approx(0.045)  # halfway: halfway
    assert collective_s("all_gather", 16 << 20, 2, 8, rates) == pytest.approx(0.010)
    # Outside the measured sizes, or on another number of ranks: the fitted line, as before.
    line = 1e-3 + (128 << 20) * 0.5 / 1e9
    assert collective_s("all_gather", 128 << 20, 2, 8, rates) == pytest.approx(line)
    assert collective_s("all_gather", 40 << 20, 4, 8, rates) == pytest.approx(3e-3 + (40 << 20) * 0.75 / 1e9)


def test_the_engines_gradient_buffer_passes_at_the_measured_copy_rates():
    from dataclasses import replace

    from zerotrain.planning.hardware_rates import named_rates
    from zerotrain.planning.ladder import Rung
    from zerotrain.planning.step_time import _buffer_passes

    rates = replace(named_rates("h100"), copy_gbps=10.0, fresh_copy_gbps=2.0)
    whole, shard, gb = 250_000_000, 125_000_000, 1e9  # elements: 1 GB and 0.5 GB in fp32, 2 ranks
    # Stage 0, accumulation 2: two copies into the kept buffer, one scaling after the all-reduce, the norm
    # and clip over the whole gradient (1.5 copies): 4.5 GB at 10 GB/s.
    assert _buffer_passes(Rung(0), 2, whole, whole, 4, 2, rates) == pytest.approx(4.5 * gb / 10e9)
    # Stage 2: both copies into a new buffer (2 GB at 2 GB/s), and every micro-step scales (2 GB) and adds
    # its slice into the shard (2 x 1.5 x 0.5 GB); norm, clip and clearing the shard (2 x 0.5 GB).
    assert _buffer_passes(Rung(2), 2, whole, shard, 4, 2, rates) == pytest.approx(1.0 + (2 + 1.5 + 1) * gb / 10e9)
    assert _buffer_passes(Rung(0), 1, whole, whole, 4, 1, rates) == pytest.approx(2.5 * gb / 10e9)  # no scaling
    assert _buffer_passes(Rung(2), 2, whole, shard, 4, 2, named_rates("h100")) == 0.0  # no copy rate measured


@pytest.mark.slow  # starts processes: `make test`, not `make check`
@pytest.mark.timeout(300)
def test_the_validation_pipeline_predicts_a_real_run_within_a_factor_of_two(zerotrain_cli, tmp_path):
    """The live path of cpu_validate.py end to end: bench comm, bench compute, `zerotrain train`, the
    prediction, each as small as still measures (the probes' sizes and iterations, 1 + 3 steps of a run on
    400 generated samples): most of its time is the processes starting. Under `make test` another worker
    shares the 2 cores, so only a gross miss (a unit, a missing term) fails here; the tight figures are
    the recorded runs' in test_step_time_recorded_runs.py, this same run among them (within 11%)."""
    import time

    v = _validate()
    model, ranks, warmup, steps = v.MODELS["5m"], 2, 1, 3
    port = lambda: free_port("127.0.0.1")  # noqa: E731
    began = time.perf_counter()
    comm = v.comm_probe(zerotrain_cli, tmp_path, ranks, max_size="4M", iters=2, port=port)
    probed_comm = time.perf_counter()
    compute = v.compute_probe(zerotrain_cli, tmp_path, model, ranks, iters=3)
    probed_compute = time.perf_counter()
    measured, load = v.train_steps(zerotrain_cli, tmp_path, model, ranks, "z0", warmup, steps, port=port,
                                   extra=("--data.synthetic.num_examples", 400))
    trained = time.perf_counter()
    assert len(measured) == steps
    row = v.Row("5m", ranks, "z0", 4, 2, measured, v.predict(model, ranks, "z0", compute, comm).as_dict(), load)
    table = v.markdown([row], "pytest", 2)
    print(table)  # shown with -s, and on a failure
    print(f"bench comm {probed_comm - began:.0f} s, bench compute {probed_compute - probed_comm:.0f} s, "
          f"train {trained - probed_compute:.0f} s")
    assert 0.5 < row.predicted["step_s"] / row.measured_s < 2.0, table
