"""What a `zerotrain train` run reports and leaves behind says what happened.

- per-rank model-state memory (parameters, gradients, optimizer states, buffers) beside
  the process figures, and a peak never below the current figure;
- output that is not a terminal gets whole lines (no folding at 80 columns) and no
  progress bar, with tokenization reported in plain lines;
- a missing TensorBoard or W&B package is a config error naming the key and pip command;
- `zerotrain consolidate --hf` on a run's checkpoints writes the run's tokenizer, the
  architecture, and files with the usual mode.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ZerotrainCLI, run_on_ranks

BAR_CHARACTERS = "━╸╺█▏▎▍▌▋▊▉"


# --- memory figures ----------------------------------------------------------------------


def test_reported_peak_is_never_below_the_current_figure(monkeypatch):
    from zerotrain.train import metrics

    # getrusage and /proc/self/statm are read at different moments: simulate a stale, low peak.
    monkeypatch.setattr(metrics.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=1))
    readings = [metrics.memory_of_this_rank(torch.device("cpu")) for _ in range(3)]
    for current, peak in readings:
        assert current > 0.01 and peak >= current, readings
    peaks = [peak for _, peak in readings]
    assert peaks == sorted(peaks), "the peak is a running maximum"


def _model_states(stage: int) -> list:
    """Every rank's memory after one step of the default model at `stage` (fp32, 2 ranks; a collective)."""
    import zerotrain
    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.data import load_tokenizer
    from zerotrain.train.metrics import gather_memory
    from zerotrain.train.model import build_model, decay_groups
    from zerotrain.train.zero_fill import build_engine_config

    cfg = load_train_config(None, ["--zero.zero_optimization.stage", str(stage),
                                   "--zero.zero_optimization.stage3_param_persistence_threshold", "0"])
    torch.manual_seed(0)
    tokenizer = load_tokenizer(cfg.model.tokenizer, None)
    model = build_model(cfg.model, tokenizer, zero_init=cfg.zero_dict() if stage == 3 else None)
    engine_cfg, _ = build_engine_config(cfg, model=model, world_size=2, device_type="cpu", total_steps=10)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=decay_groups(model, 0.0), config=engine_cfg)
    ids = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 32))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return gather_memory(torch.device("cpu"), engine)


def _stages_0_and_3() -> tuple[list, list]:
    from zerotrain.comm.distributed import init_distributed

    init_distributed()
    return _model_states(0), _model_states(3)


@pytest.mark.slow
def test_stage3_model_states_per_rank_are_half_of_stage0s():
    stage0, stage3 = run_on_ranks(2, _stages_0_and_3)[0]
    assert len(stage0) == len(stage3) == 2  # every rank's figures, gathered on each
    for r in range(2):
        full, sharded = stage0[r], stage3[r]
        columns = sharded.columns(r)
        assert {f"mem_{k}_gb_r{r}" for k in ("alloc", "peak", "params", "grads", "optim", "buffers",
                                            "model_states")} == set(columns)
        # ZeRO's accounting in fp32 (the master is the parameter): stage 0 holds 4Ψ + 4Ψ + 8Ψ
        # (Adam's two moments), stage 3 on N=2 ranks (4 + 4 + 8)Ψ/N, less a few padding elements.
        for kind in ("params", "grads", "optim"):
            assert getattr(full, kind) > 0
            assert getattr(sharded, kind) == pytest.approx(getattr(full, kind) / 2, rel=0.01), kind
        assert full.optim == pytest.approx(2 * full.params, rel=0.01)
        assert sharded.buffers == full.buffers > 0  # rotary inv_freq: every rank keeps its own
        held = sharded.model_states - sharded.buffers
        assert held == pytest.approx((full.model_states - full.buffers) / 2, rel=0.01)
        assert columns[f"mem_model_states_gb_r{r}"] == sharded.model_states


# --- missing optional packages -------------------------------------------------------------


@pytest.mark.parametrize("key, module, command", [
    ("wandb", "wandb", "pip install wandb"),
    ("tensorboard", "torch.utils.tensorboard", "pip install 'zerotrain[tensorboard]'"),
])
def test_missing_sink_package_is_a_config_error_naming_key_and_command(tmp_path, monkeypatch, key, module, command):
    from zerotrain.config.errors import ConfigError
    from zerotrain.train.config import LoggingSection
    from zerotrain.train.metrics import MetricsLog

    monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises ImportError
    section = LoggingSection(**{key: {"enabled": True}})
    with pytest.raises(ConfigError) as error:
        MetricsLog(section, tmp_path, rank=0, world_size=1, resume_step=0, run_config={})
    message = str(error.value)
    assert f"logging.{key}.enabled" in message and command in message, message
    assert not (tmp_path / "metrics.csv").exists(), "it fails before anything is written"


# --- tokenization progress -----------------------------------------------------------------


def test_tokenizing_off_a_terminal_reports_plain_lines(monkeypatch):
    from io import StringIO

    from rich.console import Console

    from zerotrain.train.data import tokenize_progress

    monkeypatch.setattr(tokenize_progress, "QUARTER_LINES_AFTER_S", 0.0)
    out = StringIO()
    with tokenize_progress.TokenizeProgress("train.jsonl", total_bytes=4_000_000, console=Console(file=out)) as p:
        for _ in range(8):
            p.advance_bytes(500_000)
            p.count_document()
    p.finish(8, 1234)
    lines = out.getvalue().splitlines()
    assert lines[0] == "tokenizing train.jsonl (4.0 MB)"
    assert lines[1:4] == [f"tokenizing train.jsonl: {q}% ({mb:.1f}/4.0 MB, {docs} documents)"
                          for q, mb, docs in ((25, 1.0, 1), (50, 2.0, 3), (75, 3.0, 5))]  # bytes are read first
    assert lines[4].startswith("tokenized train.jsonl: 8 documents, 1,234 tokens in ")
    assert len(lines) == 5 and not any(c in out.getvalue() for c in BAR_CHARACTERS)


# --- a real run, its output and its export --------------------------------------------------


def _stage3_job(root: Path) -> list:
    """A short 2-rank stage-3 job's arguments (no output folder, no schedule)."""
    return ["train", "--data.cache_dir", root / "cache", "--nproc_per_node", "2", "--zero.zero_optimization.stage", "3",
            "--logging.interval", "1", "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "400"]


@pytest.fixture(scope="module")
def stage3_run(tmp_path_factory):
    """A short 2-rank stage-3 run (2 steps, evaluated at steps 0 and 2), output captured (not a
    terminal), under umask 022. Shared by the output, export and summary tests (one launch, not two)."""
    root = tmp_path_factory.mktemp("run_output")
    (root / "cwd").mkdir()
    run = root / "run"
    previous = os.umask(0o022)
    try:
        proc = ZerotrainCLI(root / "cwd")(*_stage3_job(root), "--output.dir", run, "--training.max_steps", "2",
                                          "--training.eval_interval", "2", check=True)
    finally:
        os.umask(previous)
    return run, proc


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_output_off_a_terminal_has_whole_lines_and_no_bar(stage3_run):
    run, proc = stage3_run
    output = proc.stdout + proc.stderr
    metrics_lines = [line for line in proc.stdout.splitlines() if line.startswith("step 1 |")]
    assert len(metrics_lines) == 1, output[-3000:]
    line = metrics_lines[0]
    assert len(line) > 80 and "| mem r0 model states" in line and "; r1 model states" in line, line
    assert "tok/s total |" in line and "samples/s total |" in line and "TFLOP/s per rank" in line, line
    assert not any(c in output for c in BAR_CHARACTERS), output[-3000:]
    assert "tokenizing synthetic arithmetic" in proc.stderr and "tokenized synthetic arithmetic" in proc.stderr
    # The model's size is said before the first step, counted whole although ZeRO-3 shards it.
    starts = [line for line in proc.stdout.splitlines() if line.startswith("model: LlamaForCausalLM, ")]
    assert len(starts) == 1 and "591,232 parameters; 2 ranks" in starts[0], output[-3000:]

    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]
    for row in rows:
        for r in (0, 1):
            assert float(row[f"mem_model_states_gb_r{r}"]) > 0
            assert float(row[f"mem_alloc_gb_r{r}"]) <= float(row[f"mem_peak_gb_r{r}"])


def _modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir() if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_consolidate_hf_writes_the_runs_tokenizer_and_architecture(stage3_run, zerotrain_main, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerotrain.train.data import byte_tokenizer

    run, _ = stage3_run
    out = tmp_path / "exported"
    previous = os.umask(0o022)
    try:
        # The command in this process (it reads files, starts no rank); tests/faults/test_consolidate_killed.py
        # runs it through the console script.
        zerotrain_main("consolidate", run / "checkpoints", out, "--hf", check=True)
    finally:
        os.umask(previous)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokenizer, reference = AutoTokenizer.from_pretrained(out), byte_tokenizer()
    assert len(tokenizer) == len(reference) > 1
    assert tokenizer("12+7=19")["input_ids"] == reference("12+7=19")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == len(reference)
    # Weights and every other file: the mode any file gets under umask 022, here and in the run's hf/.
    for directory in (out, run / "hf"):
        modes = _modes(directory)
        assert "model.safetensors" in modes and "tokenizer.json" in modes, modes
        assert all(mode == 0o644 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_summary_names_the_newest_evaluation_and_its_step_also_after_a_resume(stage3_run, zerotrain_cli, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(stage3_run[0], run)  # resumed in a copy: the shared run stays as it finished
    first = json.loads((run / "summary.json").read_text())
    assert first["eval_step"] == 2 and first["eval_loss"] > 0
    # The resumed segment does not evaluate: its summary keeps the earlier segment's newest evaluation.
    zerotrain_cli(*_stage3_job(stage3_run[0].parent), "--output.dir", run, "--training.max_steps", "3",
                  "--training.eval_interval", "0", "--output.export_hf", "false", "--resume", check=True)
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 3
    assert (resumed["eval_step"], resumed["eval_loss"]) == (2, pytest.approx(first["eval_loss"], rel=1e-5))
