"""The GPU check kit rehearsed on the CPU: `benchmarks/gpu/run.sh` with GPU_CHECK_DRY=1 runs every part
(tiny sizes, Gloo) through the same wheel install line and writes the same result files, so a GPU
session finds scripts that already work (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "gpu" / "run.sh"


def _run(tmp_path: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
            "GPU_CHECK_SITE": str(tmp_path / "site"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(RUN), *args], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=timeout)


def test_an_unknown_part_is_refused_with_the_usage(tmp_path):
    done = _run(tmp_path, "fast")
    assert done.returncode == 2 and "usage: benchmarks/gpu/run.sh correct|speed|size|multi|longseq|all" in done.stderr


def test_without_a_gpu_the_real_check_refuses_and_names_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real check would run")
    done = _run(tmp_path, "correct", GPU_CHECK_DRY="0")
    assert done.returncode == 2
    assert "no CUDA GPU is visible" in done.stderr and "GPU_CHECK_DRY=1" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dry_gpu_check_runs_every_part_and_writes_its_results(tmp_path):
    if not (REPO / ".whl" / "manifest.json").is_file():
        pytest.fail("no .whl/manifest.json: `make test` runs `make gpu-wheels` first; run it", pytrace=False)
    done = _run(tmp_path, "all", timeout=1140, GPU_CHECK_DRY="1")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    # every wheel of the manifest, DeepSpeed's group too, was installed by the real pip line
    wheels = json.loads((REPO / ".whl" / "manifest.json").read_text())["wheels"]
    assert f"all {len(wheels)} wheels of the manifest installed" in done.stdout, done.stdout[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.endswith(".tar.gz")) == [
        f"{part}.{ext}" for part in ("correct", "longseq", "multi", "size", "speed") for ext in ("json", "log", "md")
    ]

    correct = json.loads((out / "correct.json").read_text())
    assert correct["meta"]["dry"] and correct["meta"]["pytest_exit"] == 0
    # The dry selection: the one-GPU case of `bench comm` (parity's one-GPU cases repeat its CPU cases;
    # they run on a real GPU only). Every selected case passed, and the table counts it.
    assert [(t["nodeid"], t["outcome"]) for t in correct["tests"]] == [
        ("tests/bench/test_comm.py::test_comm_on_this_machine_alone_measures_every_collective[gpu-1process]", "passed")
    ], correct["tests"]
    assert [(a["area"], a["passed"]) for a in correct["areas"]] == [("`zerotrain bench comm` on one GPU", 1)]
    assert "| **all** | 1 | 0 | 0 |" in (out / "correct.md").read_text()

    speed = json.loads((out / "speed.json").read_text())
    assert speed["meta"]["dry"] and speed["meta"]["complete"] and speed["zerotrain_ok"]
    for engine in ("plain", "zerotrain-0", "zerotrain-1", "zerotrain-2", "zerotrain-3"):
        for mode in ("off", "on"):  # activation checkpointing
            row = speed["results"][engine][mode]
            assert row["ok"] and row["tokens_per_s"] > 0 and row["planner_gib"] > 0, (engine, mode, row)
            assert row["loss_final"] < row["loss_first"], (engine, mode, "did not train")
            # every step lowers it: an untrained model's loss only wanders from batch to batch (by ~0.01 at
            # the dry sizes, where a step of training takes ~0.1 off), so one lower final loss could be luck
            losses = row["losses"]
            assert all(b < a for a, b in zip(losses, losses[1:])), (engine, mode, losses, "did not train")
    assert {t["target"].split(" ")[0] for t in speed["targets"]} >= {"zerotrain-0"}
    assert "| zerotrain-3 | on |" in (out / "speed.md").read_text()
    # the compiled columns (engine.compile, and FSDP2's per-block compile) and micro-batch 2 ran and trained
    assert speed["job"]["compile_backend"] == "aot_eager"
    for column in ("zerotrain-3-compile", "fsdp2-compile", "zerotrain-0-mb2"):
        for mode in ("off", "on"):
            row = speed["results"][column][mode]
            assert row["ok"] and row["loss_final"] < row["loss_first"], (column, mode, row)
            assert row["micro_batch"] == 2 and ("compile" not in column or row["compile_s"] > 0), (column, row)
    assert speed["results"]["deepspeed-3-compile"]["off"]["skipped"]  # no DeepSpeed in this venv

    multi = json.loads((out / "multi.json").read_text())
    assert multi["ok"] and multi["meta"]["world"] == 2, (out / "multi.md").read_text()
    # every stage at world 2 trained like world 1, and each rank held its share of what the stage shards
    assert [(v["stage"], v["ok"]) for v in multi["parity"]["losses"]] == [(s, True) for s in range(4)]
    assert [r["sharded"] for r in multi["parity"]["memory"][3]["ranks"]] == [
        pytest.approx(0.5, abs=0.03)] * 2, multi["parity"]["memory"]
    assert multi["comm"]["result"]["ranks"] == 2 and multi["speed"]["results"]["zerotrain-3"]["off"]["ok"]
    size = json.loads((out / "size.json").read_text())
    assert size["dry"]
    for mode in ("zero2-offload-opt", "zero3-offload-opt-param"):
        found = size["results"][mode]["zerotrain"]
        # the dry run's fake host limit makes the search find a size that trains and the next that does not
        assert found["largest"] and found["tokens_per_s_at_largest"] > 0, (mode, found)
        assert found["first_failing_reason"] == "host memory", (mode, found)
        assert size["planner"][mode]["largest"], mode
    assert "predicted largest" in (out / "size.md").read_text()
    longseq = json.loads((out / "longseq.json").read_text())
    # both modes ran the planner's ZeRO-3 rung and trained a length; every target has a verdict
    assert longseq["dry"] and set(longseq["results"]["tiny"]) == {"plain", "alst"}, longseq["results"]
    for mode, found in longseq["results"]["tiny"].items():
        assert found["rung"].startswith("stage 3") and found["longest"], (mode, found)
        assert all(t["status"] == "ok" and t["median_step_s"] > 0 for t in found["trials"]), (mode, found["trials"])
    assert [t["verdict"] in ("met", "missed", "not shown") for t in longseq["targets"]] == [True] * 3
    assert "| tiny | alst |" in (out / "longseq.md").read_text()
