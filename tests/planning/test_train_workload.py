"""The step predictions of `zerotrain train` and of `bench report --predict` count a train YAML's
long-sequence switches (training.sequence_parallel_size, tiled_mlp, offload_activations)."""

from __future__ import annotations

import argparse
import json

import pytest

from zerotrain.planning.activation_memory import LongSequence

SWITCHES = ["--training.sequence_parallel_size=2", "--training.tiled_mlp=true",
            "--training.offload_activations=true", "--training.gradient_checkpointing=true"]
EXPECTED = LongSequence(sequence_parallel=2, tiled_mlp=True, offload_activations=True)


def _cfg():
    from zerotrain.train.config_files import load_train_config

    return load_train_config(None, SWITCHES)  # the embedded default job: a small Llama


def _probe(tmp_path) -> str:
    probe = tmp_path / "compute.json"
    probe.write_text(json.dumps({"kind": "zerotrain-bench-compute", "version": 1, "device_type": "cpu",
                                 "device": "cpu (test)", "matmul_tflops": 0.02, "cpu_adam_elements_per_s": 2e8}))
    return str(probe)


@pytest.fixture
def workloads(monkeypatch) -> list:
    """The workloads `predict_step` is asked about, recorded on their way through."""
    from zerotrain.planning import step_time

    seen, real = [], step_time.predict_step

    def recording(model, rung, workload, *args, **kwargs):
        seen.append(workload)
        return real(model, rung, workload, *args, **kwargs)

    monkeypatch.setattr(step_time, "predict_step", recording)
    return seen


def test_a_train_runs_prediction_counts_its_long_sequence_switches(tmp_path, workloads):
    from zerotrain.cli.train_prediction import predict_train_step

    cfg = _cfg()
    cfg.logging.compute_probe = _probe(tmp_path)
    predicted = predict_train_step(cfg, 2, 2)
    assert predicted is not None and [w.long_sequence for w in workloads] == [EXPECTED]


def test_a_bench_jobs_prediction_counts_its_long_sequence_switches(tmp_path, workloads):
    from zerotrain.bench.job_prediction import predict_job

    job = tmp_path / "job"
    (job / "train").mkdir(parents=True)
    (job / "hostfile").write_text("node1 slots=2\n")
    _cfg().write(job / "train")
    speeds = argparse.Namespace(gpu=None, intra_node=None, inter_node=None, compute=_probe(tmp_path), comm=None,
                                gpu_memory=None)
    predicted, why = predict_job(job, speeds)
    assert predicted and not why, why
    assert [w.long_sequence for w in workloads] == [EXPECTED]
