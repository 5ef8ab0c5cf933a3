"""Reading `zerotrain train`'s YAML config: the built-in default, inherit, command-line overrides,
validation, zero as a DeepSpeed file, the written copy, and the docs listing every key."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from train_config_fixtures import TINY, engine, error_of, with_model, write
from zerotrain.train.config import DEFAULT_CONFIG_PATH, TrainConfig
from zerotrain.train.config_files import load_train_config, parse_overrides


# --------------------------------------------------------------------------- #
# the built-in default


def test_default_config_loads_and_validates():
    cfg = load_train_config(None)
    assert DEFAULT_CONFIG_PATH.is_file()
    assert cfg.model.architecture == "llama" and cfg.model.tokenizer == "byte"
    assert "vocab_size" not in cfg.model.config_overrides  # the trainer sets it from the tokenizer
    assert cfg.data.format == "synthetic" and cfg.data.synthetic.task == "arithmetic"
    assert cfg.training.max_steps and cfg.training.max_steps <= 500
    assert cfg.zero["zero_optimization"]["stage"] == 2
    assert cfg.output.dir == "runs/demo"
    resolved, _ = engine(cfg, total_steps=cfg.training.max_steps)
    assert resolved.compute_dtype == torch.float32  # on a CPU


def test_missing_model_section_is_a_clear_error(tmp_path):
    message = error_of(load_train_config, write(tmp_path / "run.yaml", "training:\n  lr: 0.1\n"))
    assert "model section is missing" in message and "model.architecture" in message


def test_model_needs_exactly_one_source(tmp_path):
    both = write(tmp_path / "run.yaml", "model:\n  architecture: llama\n  config: c.json\n")
    assert "config and architecture are both set" in error_of(load_train_config, both)
    none = write(tmp_path / "none.yaml", "model:\n  tokenizer: byte\n")
    assert "model: set one of path" in error_of(load_train_config, none)


# --------------------------------------------------------------------------- #
# inherit


def test_inherit_two_levels_relative_paths_and_order(tmp_path):
    write(tmp_path / "bases/root.yaml", """\
        model: {architecture: llama, config_overrides: {hidden_size: 64, num_hidden_layers: 2}}
        training: {lr: 0.1, micro_batch_size: 2, betas: [0.8, 0.9]}
        output: {dir: root}
        """)
    write(tmp_path / "bases/mid.yaml", """\
        inherit: [root.yaml]
        training: {lr: 0.2}
        output: {dir: mid}
        """)
    write(tmp_path / "bases/other.yaml", "output: {dir: other}\ndata: {seq_len: 32}\n")
    run = write(tmp_path / "run.yaml", """\
        inherit: [bases/mid.yaml, bases/other.yaml]
        model: {config_overrides: {hidden_size: 128}}
        training: {betas: [0.5, 0.6]}
        """)
    cfg = load_train_config(run)
    # mapping keys merge deeply; the including file wins; later inherited files win over earlier ones
    assert cfg.model.config_overrides == {"hidden_size": 128, "num_hidden_layers": 2}
    assert cfg.training.lr == 0.2 and cfg.training.micro_batch_size == 2
    assert cfg.training.betas == (0.5, 0.6)  # lists are replaced, not merged
    assert cfg.output.dir == "other" and cfg.data.seq_len == 32
    assert "root.yaml" in cfg.source and "mid.yaml" in cfg.source


def test_a_later_model_source_replaces_an_inherited_one(tmp_path):
    write(tmp_path / "base.yaml", "model: {architecture: llama, tokenizer: byte}\n")
    run = write(tmp_path / "run.yaml", "inherit: base.yaml\nmodel: {path: some/dir}\n")
    cfg = load_train_config(run)
    assert (cfg.model.path, cfg.model.architecture, cfg.model.tokenizer) == ("some/dir", None, "byte")


def test_inherit_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", TINY + "inherit: [b.yaml]\n")
    write(tmp_path / "b.yaml", "inherit: [a.yaml]\n")
    message = error_of(load_train_config, tmp_path / "a.yaml")
    assert message.startswith("inherit cycle:") and "a.yaml -> " in message and "b.yaml" in message


def test_inherit_missing_file_is_an_error(tmp_path):
    run = write(tmp_path / "run.yaml", TINY + "inherit: [nowhere.yaml]\n")
    message = error_of(load_train_config, run)
    assert "run.yaml: inherit: nowhere.yaml not found" in message and str(tmp_path / "nowhere.yaml") in message


def test_missing_config_file_is_an_error(tmp_path):
    assert "config file not found" in error_of(load_train_config, tmp_path / "absent.yaml")


# --------------------------------------------------------------------------- #
# command-line overrides


def test_override_values_are_read_as_yaml():
    pairs = dict(parse_overrides([
        "--training.micro_batch_size", "4", "--training.lr", "1e-4", "--training.gradient_checkpointing=true",
        "--training.betas", "[0.9,0.95]", "--training.max_steps", "null", "--data.path", "a b.txt",
        "--zero.zero_optimization.stage", "3", "--data.text_field", "{not yaml",
    ]))
    assert pairs["training.micro_batch_size"] == 4 and pairs["training.lr"] == 1e-4
    assert pairs["training.gradient_checkpointing"] is True and pairs["training.betas"] == [0.9, 0.95]
    assert pairs["training.max_steps"] is None and pairs["data.path"] == "a b.txt"
    assert pairs["zero.zero_optimization.stage"] == 3 and pairs["data.text_field"] == "{not yaml"


def test_overrides_apply_over_the_file_including_nested_zero_keys(tmp_path):
    run = write(tmp_path / "run.yaml", TINY + "zero: {zero_optimization: {stage: 1, reduce_bucket_size: 1000}}\n")
    cfg = load_train_config(run, [
        "--training.micro_batch_size", "4", "--zero.zero_optimization.stage", "2",
        "--zero.gradient_clipping", "0.5", "--model.config_overrides.hidden_size", "64",
    ])
    assert cfg.training.micro_batch_size == 4 and cfg.model.config_overrides == {"hidden_size": 64}
    assert cfg.zero["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert cfg.zero["gradient_clipping"] == 0.5
    assert "with the command-line overrides" in cfg.source


def test_override_of_an_unknown_key_suggests_the_right_one():
    message = error_of(load_train_config, None, ["--training.micro_batchsize", "4"])
    assert "--training.micro_batchsize: unknown key 'micro_batchsize' in training" in message
    assert "did you mean 'micro_batch_size'?" in message
    message = error_of(load_train_config, None, ["--trainig.lr", "1"])
    assert "unknown section 'trainig'; did you mean 'training'?" in message
    assert "is a value, not a section" in error_of(load_train_config, None, ["--training.lr.x", "1"])


def test_override_of_an_unknown_zero_key_is_reported_with_its_dotted_path():
    message = error_of(load_train_config, None, ["--zero.zero_optimization.stag", "3"])
    assert "zero.zero_optimization.stag: unknown key 'stag'; did you mean 'stage'?" in message


def test_override_flag_needs_a_value_and_a_section():
    assert "--training.lr is missing its value" in error_of(parse_overrides, ["--training.lr"])
    assert "--training.lr is missing its value" in error_of(parse_overrides, ["--training.lr", "--data.seq_len", "8"])
    assert "not an override" in error_of(parse_overrides, ["--lr", "1"])
    assert "unexpected argument" in error_of(parse_overrides, ["stray"])


def test_override_values_are_validated_like_file_values():
    message = error_of(load_train_config, None, ["--training.micro_batch_size", "four"])
    assert 'training.micro_batch_size: got "four", expected a positive integer' in message


# --------------------------------------------------------------------------- #
# validation


def test_unknown_keys_and_wrong_types_name_the_file_and_dotted_path(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batchsize: 4, lr_schedule: cosin, eval_interval: -1}
        data: {eval_fraction: 1.0}
        logging: {wandb: {enabeld: true}}
        zero: {zero_optimization: {stage: two}}
        """))
    message = error_of(load_train_config, run)
    assert f"invalid zerotrain train config in {run}" in message
    assert "training.micro_batchsize: unknown key 'micro_batchsize'; did you mean 'micro_batch_size'?" in message
    assert 'training.lr_schedule: got "cosin", expected one of "cosine", "linear", "constant"' in message
    assert "training.eval_interval: got -1, expected a non-negative integer" in message
    assert "data.eval_fraction: got 1.0" in message
    assert "logging.wandb.enabeld: unknown key 'enabeld'; did you mean 'enabled'?" in message
    assert 'zero.zero_optimization.stage: got "two", expected an integer from 0 to 3' in message


def test_unknown_section_suggests_the_right_one(tmp_path):
    message = error_of(load_train_config, write(tmp_path / "run.yaml", TINY + "trainig: {lr: 1}\n"))
    assert "trainig: unknown key 'trainig'; did you mean 'training'?" in message


def test_resume_accepts_auto_never_a_path_and_booleans():
    assert load_train_config(None, ["--training.resume", "true"]).training.resume == "auto"
    assert load_train_config(None, ["--training.resume", "runs/x/checkpoints/step_10"]).training.resume.endswith("10")


# --------------------------------------------------------------------------- #
# zero as a file, and the written config


def test_zero_as_a_path_to_a_json_file_with_comments_relative_to_the_yaml(tmp_path):
    write(tmp_path / "conf/ds.jsonc", """\
        {
          // copied from a guide
          "zero_optimization": {"stage": 1},  # hash comments too
          "gradient_clipping": "auto",
        }
        """)
    write(tmp_path / "conf/base.yaml", "zero: {zero_optimization: {stage: 2, reduce_bucket_size: 7}}\n")
    run = write(tmp_path / "conf/run.yaml", TINY + "inherit: [base.yaml]\nzero: ds.jsonc\n")
    cfg = load_train_config(run)
    # a DeepSpeed file is a whole config: it replaces the inherited zero instead of merging into it
    assert cfg.zero == {"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"}
    assert "bad.yaml: zero: config file not found" in error_of(
        load_train_config, write(tmp_path / "conf/bad.yaml", TINY + "zero: missing.json\n"))


def test_write_then_load_gives_the_same_config(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {lr: 2.0e-4, betas: [0.8, 0.99], max_steps: 7}
        zero: {zero_optimization: {stage: 1}, train_micro_batch_size_per_gpu: auto, gradient_clipping: 0.5}
        """))
    cfg = load_train_config(run, ["--data.seq_len", "32"])
    written = cfg.write(tmp_path / "out")
    assert written == tmp_path / "out" / "config.yaml"
    again = load_train_config(written)
    from zerotrain.train.config import absolute_paths

    assert again.as_dict() == absolute_paths(cfg.as_dict())  # the same config, its paths absolute
    assert again.output.dir == str(Path.cwd() / cfg.output.dir)
    assert again.training.grad_clip == 0.5  # adopted from zero while loading, written as such
    assert "inherit" not in yaml.safe_load(written.read_text())


# --------------------------------------------------------------------------- #
# the docs


def test_docs_list_every_config_key():
    from pydantic import BaseModel

    docs = (Path(__file__).parents[2] / "docs" / "training.md").read_text()

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from keys(ann, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    missing = [k for section in ("model", "data", "training", "logging", "output")
               for k in keys(TrainConfig.model_fields[section].annotation) if f"`{k}`" not in docs]
    assert not missing, f"docs/training.md lacks {missing}"
