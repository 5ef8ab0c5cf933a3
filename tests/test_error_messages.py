"""User errors end in one message naming the file or key and the fix, never a traceback.

Covered: an unknown model architecture, a model config that cannot build, a broken weights
file, a corrupt checkpoint shard (train, engine and consolidate), DeepSpeed monitor sections,
`zerotrain config check` on a `zerotrain train` YAML, unexpected errors (ZEROTRAIN_DEBUG=1
for the traceback) and help piped into `head`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import zerotrain_script
from zerotrain.checkpoint import CheckpointError, CheckpointReader
from zerotrain.config import ConfigError, check_supported, load_config
from zerotrain.config.unsupported import MONITORS

# A `zerotrain train` job as short as it gets: the default tiny Llama, one process, few examples.
# The errors raised before any rank starts run the command in this process (`zerotrain_main`): one
# console-script run per command (a misspelt override for train, config check, consolidate) shows
# the CLI wiring; the others would each spend seconds importing torch and transformers again.
SHORT = ["--nproc_per_node", "1", "--training.max_steps", "1", "--training.micro_batch_size", "4",
         "--training.eval_interval", "0", "--data.synthetic.num_examples", "200", "--output.export_hf", "false"]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    # A developer's ZEROTRAIN_DEBUG=1 would add the tracebacks these tests check are absent.
    monkeypatch.delenv("ZEROTRAIN_DEBUG", raising=False)


def _train(cli, tmp_path: Path, run: str, *args: str):
    return cli("train", "--output.dir", tmp_path / run, "--data.cache_dir", tmp_path / "cache", *SHORT, *args)


def _one_message(proc, *expected: str) -> str:
    """The stderr of a command that failed on the user's input (exit 2), checked for the expected text."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    for text in expected:
        assert text in proc.stderr, proc.stderr
    return proc.stderr


# --- the model section ------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_architecture_suggests_the_nearest_model_type(zerotrain_main, tmp_path):
    proc = _train(zerotrain_main, tmp_path, "run", "--model.architecture", "lama")
    _one_message(proc, "model.architecture: 'lama' is not a model type transformers knows", "did you mean 'llama'?")


def test_architecture_that_is_no_causal_lm_is_named_as_such():
    from zerotrain.train.model_checks import check_architecture

    with pytest.raises(ConfigError, match="'vit' is a transformers model type, but not a causal language model"):
        check_architecture("vit")
    check_architecture("llama")


@pytest.mark.slow
def test_a_misspelt_config_override_is_refused_by_train_config_check_and_estimate_before_anything_starts(
        zerotrain_cli, zerotrain_main, tmp_path):
    # `hiden_size` used to become a stray attribute: a model of the default size trained, exit 0.
    expected = ("model.config_overrides: 'hiden_size' (did you mean 'hidden_size'?) is not a setting of LlamaConfig",)
    proc = _train(zerotrain_cli, tmp_path, "run", "--model.config_overrides.hiden_size", "64")
    assert _one_message(proc, *expected).count("hiden_size' (did you mean") == 1, "said once, by the launcher"
    assert not (tmp_path / "run").exists(), "nothing written: no rank started"
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  architecture: llama\n  config_overrides:\n    hiden_size: 64\n")
    _one_message(zerotrain_main("config", "check", config), *expected)
    _one_message(zerotrain_main("estimate", "llama", "--config-override", "hiden_size=1024"), *expected)
    # keys transformers reads and folds in elsewhere are settings too
    assert zerotrain_main("estimate", "llama", "--config-override", "rope_theta=10000").returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["missing data file", "bad jsonl line", "hub id"])
def test_data_and_model_path_errors_are_said_once_before_any_rank_starts(zerotrain_main, capfd, tmp_path, problem):
    # They used to appear once per rank, ~12 s in, under a "launch failed" box, leaving a config.yaml.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    args, expected = {
        "missing data file": (["--data.format", "auto", "--data.path", str(tmp_path / "nope.jsonl")],
                              "data.path: " + str(tmp_path / "nope.jsonl") + " does not exist"),
        "bad jsonl line": (["--data.format", "auto", "--data.path", str(bad)], "bad.jsonl, line 2: not valid JSON"),
        "hub id": (["--model.path", "meta-llama/Llama-3.2-1B", "--model.architecture", "null"],
                   "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir"),
    }[problem]
    proc = _train(zerotrain_main, tmp_path, "run", *args)
    _one_message(proc, expected)
    # In this process: a rank started would write to the inherited file descriptors, not to proc.stderr.
    said = proc.stderr + capfd.readouterr().err
    assert said.count(expected) == 1, "said once, by the launching process"
    assert "rank 0" not in said and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_model_config_that_cannot_build_names_source_and_values(zerotrain_main, tmp_path):
    proc = _train(zerotrain_main, tmp_path, "run", "--model.config_overrides.hidden_size", "130")
    message = _one_message(proc, "model.architecture 'llama' with model.config_overrides", "cannot build a model")
    assert '"hidden_size": 130' in message and "fix the values in model.config_overrides" in message


class _Tokenizer:
    """What build_model reads of a tokenizer: its length and special token ids."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return 64


def _section(**fields) -> SimpleNamespace:
    base = {"path": None, "config": None, "architecture": None, "config_overrides": {}, "trust_remote_code": False}
    return SimpleNamespace(**{**base, **fields})


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": 32}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be positive"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ({"hidden_size": "big"}, "hidden_size"),
    ],
)
def test_model_sizes_transformers_would_accept_or_crash_on_are_one_message(change, expected):
    from zerotrain.train.model import build_model

    section = _section(architecture="llama", config_overrides={**TINY, **change})
    with pytest.raises(ConfigError) as caught:
        build_model(section, _Tokenizer())
    assert expected in str(caught.value)
    assert "model.architecture 'llama'" in str(caught.value) and "model.config_overrides" in str(caught.value)


def test_model_config_file_that_cannot_build_names_the_file(tmp_path):
    from zerotrain.train.model import build_model

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4}')
    with pytest.raises(ConfigError) as caught:
        build_model(_section(config=str(config)), _Tokenizer())
    assert f"model.config {config}" in str(caught.value)
    assert f"fix the values in {config}" in str(caught.value)


def _tiny_hf_dir(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=300, **TINY)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_truncated_weights_file_is_named_with_the_fix(zerotrain_main, tmp_path):
    model_dir = _tiny_hf_dir(tmp_path / "model")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = _train(zerotrain_main, tmp_path, "run", "--model.path", model_dir, "--model.tokenizer", "byte")
    _one_message(proc, f"model.path: the weights file {weights} is truncated or corrupt", "copy or download it again")


# --- a corrupt checkpoint ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A `zerotrain train` run folder with checkpoints step1 and step2."""
    from conftest import ZerotrainCLI

    root = tmp_path_factory.mktemp("two_checkpoints")
    (root / "cwd").mkdir()
    proc = _train(ZerotrainCLI(root / "cwd"), root, "run", "--training.max_steps", "2", "--training.save_interval", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "run" / "checkpoints" / "step2").is_dir()
    return root / "run"


def _corrupt_copy(run: Path, into: Path, *tags: str) -> Path:
    """A copy of `run` (a run folder or its checkpoints) whose `tags` have their rank-0 shard file cut short."""
    copy = shutil.copytree(run, into)
    config = copy / "config.yaml"
    if config.is_file():  # the copy is a run of its own: its output.dir is the copy
        config.write_text(config.read_text().replace(str(run), str(copy)))
    checkpoints = copy / "checkpoints" if config.is_file() else copy
    for tag in tags:
        shard = checkpoints / tag / "shards_rank00000.safetensors"
        shard.write_bytes(shard.read_bytes()[:200])
    return copy


@pytest.mark.slow
def test_resuming_from_a_corrupt_shard_names_it_and_gives_the_previous_tags_command(
    zerotrain_cli, tmp_path, two_checkpoints
):
    run = _corrupt_copy(two_checkpoints, tmp_path / "run", "step2")
    proc = zerotrain_cli("train", run / "config.yaml", "--resume", "--nproc_per_node", "1")
    shard = run / "checkpoints" / "step2" / "shards_rank00000.safetensors"
    command = f"zerotrain train {run / 'config.yaml'} --training.resume {run / 'checkpoints' / 'step1'}"
    message = _one_message(proc, f"cannot read {shard}: truncated or corrupt", "previous checkpoint", command)
    # The command given works: it trains on from step1.
    words = shlex.split(message[message.index(command):].splitlines()[0])
    redo = zerotrain_cli(*words[1:], "--nproc_per_node", "1")
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step2"


@pytest.mark.slow
def test_engine_user_is_told_the_load_checkpoint_call_and_when_there_is_no_earlier_tag(tmp_path, two_checkpoints):
    folder = _corrupt_copy(two_checkpoints / "checkpoints", tmp_path / "ckpt", "step2")  # no config.yaml beside it
    with pytest.raises(CheckpointError) as caught, CheckpointReader(folder) as reader:
        reader.read_param("master", next(iter(reader.params)))
    assert "step2/shards_rank00000.safetensors" in str(caught.value)
    assert f"engine.load_checkpoint({str(folder)!r}, tag='step1')" in str(caught.value)
    assert isinstance(caught.value, ConfigError)  # reported as the user's input, in one line
    shard = folder / "step1" / "shards_rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=f"no earlier intact checkpoint in {folder}"), CheckpointReader(folder) as r:
        r.read_param("master", next(iter(r.params)))


def test_garbled_meta_json_is_named_with_the_previous_tag(tmp_path, two_checkpoints):
    folder = _corrupt_copy(two_checkpoints / "checkpoints", tmp_path / "ckpt")
    (folder / "step2" / "meta.json").write_text('{"format": "zerotrain-checkpoint/1", "params": {')
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(folder)
    assert f"{folder / 'step2' / 'meta.json'} is corrupt" in str(caught.value)
    assert "tag='step1'" in str(caught.value)


@pytest.mark.slow
def test_consolidating_a_corrupt_shard_suggests_consolidating_the_previous_tag(
    zerotrain_cli, zerotrain_main, tmp_path, two_checkpoints
):
    run = _corrupt_copy(two_checkpoints, tmp_path / "run", "step2")
    out = tmp_path / "out"
    proc = zerotrain_cli("consolidate", run / "checkpoints", out)
    _one_message(proc, "zerotrain consolidate: cannot read", "step2/shards_rank00000.safetensors",
                 f"zerotrain consolidate {run / 'checkpoints'} {out} --tag step1")
    debug = zerotrain_main("consolidate", run / "checkpoints", out, env={"ZEROTRAIN_DEBUG": "1"})
    assert debug.returncode == 2
    assert "Traceback" in debug.stderr and "CorruptCheckpointError" in debug.stderr


# --- DeepSpeed monitor sections ---------------------------------------------------------------


@pytest.mark.parametrize("monitor", MONITORS, ids=lambda m: m.section)
def test_deepspeed_monitor_section_says_what_to_use_instead(monitor):
    with pytest.raises(ConfigError) as caught:
        check_supported(load_config({monitor.section: {"enabled": True}}))
    message = str(caught.value)
    assert message.startswith(f"{monitor.section}.enabled = true: zerotrain does not run DeepSpeed's monitors")
    assert "unknown key" not in message and "not built yet" not in message
    assert "log from your training loop" in message and f"set {monitor.section}.enabled to false" in message
    assert (monitor.in_train or "the YAML's logging section writes to") in message
    check_supported(load_config({monitor.section: {"enabled": False}}))  # switched off: accepted silently


@pytest.mark.slow
def test_config_check_of_a_train_yaml_points_its_monitor_at_the_logging_section(zerotrain_main, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {architecture: llama}\nzero: {wandb: {enabled: true, project: x}}\n")
    proc = zerotrain_main("config", "check", config)
    _one_message(proc, "zero.wandb.enabled = true", "set logging.wandb.enabled: true", "delete zero.wandb")


# --- zerotrain config check on a zerotrain train YAML -----------------------------------------


@pytest.mark.slow
def test_config_check_prints_a_train_yaml_merged_and_validated(zerotrain_cli, zerotrain_main, tmp_path):
    (tmp_path / "base.yaml").write_text("model: {architecture: llama}\ntraining: {lr: 1.0e-3}\n")
    config = tmp_path / "run.yaml"
    config.write_text("inherit: [base.yaml]\ntraining: {micro_batch_size: 2}\n")
    verdict = zerotrain_cli("config", "check", config, "--set", "training.max_steps=7", check=True).stdout
    assert verdict == f"{config}: valid zerotrain train config: architecture llama, synthetic arithmetic data, " \
        "ZeRO stage 2, 7 steps, output runs/train (--show prints it with every default filled in)\n"
    proc = zerotrain_main("config", "check", config, "--set", "training.max_steps=7", "--show", check=True)
    merged = yaml.safe_load(proc.stdout)
    assert merged["model"]["architecture"] == "llama"
    assert merged["training"]["lr"] == 1e-3 and merged["training"]["micro_batch_size"] == 2
    assert merged["training"]["max_steps"] == 7
    assert merged["logging"]["csv"] is True  # defaults filled in


@pytest.mark.slow
def test_config_check_of_a_bad_train_yaml_is_one_message(zerotrain_cli, zerotrain_main, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {architecture: lama}\ntraining: {micro_batch_sise: 2}\n")
    proc = zerotrain_cli("config", "check", config)
    _one_message(proc, f"invalid zerotrain train config in {config}", "micro_batch_sise",
                 "did you mean 'micro_batch_size'?")
    config.write_text("model: {architecture: lama}\n")
    _one_message(zerotrain_main("config", "check", config), "did you mean 'llama'?")


# --- unexpected errors, ZEROTRAIN_DEBUG, broken pipes -----------------------------------------


def _crash(args):
    raise KeyError("shapes")


def test_unexpected_error_is_one_line_with_a_debug_hint_and_debug_shows_the_traceback(monkeypatch, capsys):
    from zerotrain.checkpoint import consolidate_command
    from zerotrain.cli import main as cli

    monkeypatch.setattr(consolidate_command, "run_consolidate", _crash)
    assert cli.main(["consolidate", "ckpt", "out"]) == 1
    err = capsys.readouterr().err
    assert "zerotrain consolidate: KeyError: 'shapes'" in err
    assert "set ZEROTRAIN_DEBUG=1 for the full traceback" in err and "Traceback" not in err
    monkeypatch.setenv("ZEROTRAIN_DEBUG", "1")
    assert cli.main(["consolidate", "ckpt", "out"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "_crash" in err and "zerotrain consolidate: KeyError: 'shapes'" in err


@pytest.mark.slow
def test_help_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    zt = shlex.quote(zerotrain_script())
    # `head -1` stops after one line; `true` reads nothing, so that pipe is surely closed first.
    pipes = [f"{zt} --help | head -1", f"{zt} train --help | head -1", f"{zt} launch -h | head -1",
             f"{zt} train --help | true"]
    proc = subprocess.run(" && ".join(pipes), shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [["usage:", "zerotrain"]] * 3
    assert "BrokenPipe" not in proc.stderr and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["launch", "no_such_script.py"], ["consolidate", "no_such_dir", "out"]])
def test_a_users_bad_path_is_a_plain_message_not_an_unexpected_error(zerotrain_main, argv):
    proc = zerotrain_main(*argv)
    assert proc.returncode == 2
    assert argv[1] in proc.stderr
    assert "Error:" not in proc.stderr and "ZEROTRAIN_DEBUG" not in proc.stderr and "Traceback" not in proc.stderr
