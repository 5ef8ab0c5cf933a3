"""`zerotrain train`'s YAML config: inherit, overrides, validation, the built-in default, the
written copy, and filling the DeepSpeed section from the training settings (with mismatches)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.train.config import DEFAULT_CONFIG_PATH, TrainConfig
from zerotrain.train.config_files import load_train_config, parse_overrides
from zerotrain.train.zero_fill import build_engine_config, resolve_precision

TINY = "model:\n  architecture: llama\n"


class HiddenSizeModel(nn.Module):
    """One fp32 parameter and a Hugging Face-style config with a hidden size."""

    def __init__(self, hidden_size: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))
        self.config = SimpleNamespace(hidden_size=hidden_size)


def with_model(text: str) -> str:
    """A config body (indented in the test) under a minimal model section."""
    return TINY + textwrap.dedent(text)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def engine(cfg: TrainConfig, world_size: int = 2, total_steps: int | None = 100, model=None):
    return build_engine_config(
        cfg, model=model or HiddenSizeModel(), world_size=world_size, device_type="cpu", total_steps=total_steps
    )


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
    assert again.as_dict() == cfg.as_dict()
    assert again.training.grad_clip == 0.5  # adopted from zero while loading, written as such
    assert "inherit" not in yaml.safe_load(written.read_text())


# --------------------------------------------------------------------------- #
# filling "auto" from training


def test_every_auto_is_filled_from_training(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batch_size: 4, gradient_accumulation_steps: 3, lr: 2.0e-3, min_lr: 2.0e-4,
                   betas: [0.8, 0.9], eps: 1.0e-6, weight_decay: 0.1, warmup_steps: 5, grad_clip: 0.7,
                   precision: fp32}
        zero:
          train_batch_size: auto
          train_micro_batch_size_per_gpu: auto
          gradient_accumulation_steps: auto
          gradient_clipping: auto
          fp16: {enabled: auto}
          bf16: {enabled: auto}
          optimizer: {type: AdamW, params: {lr: auto, betas: auto, eps: auto, weight_decay: auto}}
          scheduler: {type: WarmupDecayLR, params: {total_num_steps: auto, warmup_num_steps: auto,
                                                    warmup_min_lr: auto, warmup_max_lr: auto}}
          zero_optimization: {stage: 2, reduce_bucket_size: auto}
        """))
    resolved, _ = engine(load_train_config(run, ["--training.lr_schedule", "linear"]), world_size=2, total_steps=50)
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (24, 4, 3)
    assert resolved.gradient_clipping == 0.7
    assert resolved.fp16.enabled is False and resolved.bf16.enabled is False
    assert resolved.optimizer.params == {"lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}
    assert resolved.scheduler.params == {
        "total_num_steps": 50, "warmup_num_steps": 5, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3}
    assert resolved.zero_optimization.reduce_bucket_size == 32 * 32  # from the model's hidden size


@pytest.mark.parametrize(
    ("schedule", "kind", "expected"),
    [
        ("cosine", "WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 4, "warmup_type": "linear",
                                      "warmup_min_ratio": 0.0, "cos_min_ratio": pytest.approx(0.1)}),
        ("linear", "WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 4, "warmup_type": "linear",
                                     "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3}),
        ("constant", "WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_min_lr": 0.0,
                                  "warmup_max_lr": 1e-3}),
    ],
)
def test_optimizer_and_schedule_are_built_from_training_when_zero_has_none(schedule, kind, expected):
    cfg = load_train_config(None, ["--training.lr_schedule", schedule, "--training.lr", "1e-3",
                                   "--training.min_lr", "1e-4", "--training.warmup_steps", "4"])
    resolved, notes = engine(cfg, total_steps=40)
    assert resolved.optimizer.type == "AdamW"
    assert resolved.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    assert resolved.scheduler.type == kind and resolved.scheduler.params == expected
    assert resolved.train_micro_batch_size_per_gpu == cfg.training.micro_batch_size
    assert resolved.gradient_clipping == cfg.training.grad_clip
    assert any("min_lr" in note for note in notes) == (schedule == "linear")


def test_no_warmup_starts_cosine_at_the_full_lr():
    resolved, _ = engine(load_train_config(None, ["--training.warmup_steps", "0"]), total_steps=40)
    assert resolved.scheduler.params["warmup_min_ratio"] == 1.0 and resolved.scheduler.params["warmup_num_steps"] == 1


def test_keys_a_user_optimizer_leaves_out_come_from_training(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {lr: 0.01}
        zero: {optimizer: {type: Adam, params: {eps: 1.0e-6}}, scheduler: {type: WarmupLR, params: {}}}
        """))
    resolved, _ = engine(load_train_config(run))
    assert resolved.optimizer.params == {"eps": 1e-6, "lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.0}
    assert resolved.scheduler.params == {"warmup_num_steps": 1, "warmup_max_lr": 0.01}


def test_precision_auto_follows_the_device(monkeypatch):
    assert resolve_precision("auto", "cpu") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cuda", {"bf16": {"enabled": False}}) == "fp32"
    assert resolve_precision("fp16", "cuda") == "fp16"


# --------------------------------------------------------------------------- #
# values set on both sides


def test_values_set_both_ways_that_disagree_are_all_listed(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batch_size: 8, lr: 3.0e-4, betas: [0.9, 0.95], grad_clip: 1.0, precision: bf16,
                   warmup_steps: 10, lr_schedule: cosine}
        zero:
          train_micro_batch_size_per_gpu: 4
          gradient_clipping: 0.5
          bf16: {enabled: false}
          optimizer: {type: AdamW, params: {lr: 1.0e-4, betas: [0.9, 0.999]}}
          scheduler: {type: WarmupLR, params: {warmup_num_steps: 100}}
        """))
    message = error_of(load_train_config, run)
    assert f"the DeepSpeed section (zero) and the training section disagree in {run}" in message
    for line in (
        "zero.train_micro_batch_size_per_gpu = 4 but training.micro_batch_size = 8",
        "zero.gradient_clipping = 0.5 but training.grad_clip = 1.0",
        "zero.optimizer.params.lr = 0.0001 but training.lr = 0.0003",
        "zero.optimizer.params.betas = [0.9, 0.999] but training.betas = [0.9, 0.95]",
        "zero.scheduler.params.warmup_num_steps = 100 but training.warmup_steps = 10",
        'zero.bf16.enabled = false but training.precision = "bf16"',
        'zero.scheduler.type = "WarmupLR" but training.lr_schedule = "cosine" (which is WarmupCosineLR)',
    ):
        assert f"  - {line}" in message
    assert 'write "auto" in zero' in message


def test_values_set_both_ways_that_agree_are_fine(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batch_size: 4, lr: 1.0e-4, betas: [0.9, 0.999], grad_clip: 0.5, max_steps: 30}
        zero:
          train_micro_batch_size_per_gpu: 4
          train_batch_size: 8
          gradient_clipping: 0.5
          optimizer: {type: AdamW, params: {lr: 0.0001, betas: [0.9, 0.999]}}
          scheduler: {type: WarmupCosineLR, params: {total_num_steps: 30}}
        """))
    cfg = load_train_config(run)
    assert cfg.notes == []
    resolved, _ = engine(cfg, world_size=2, total_steps=30)
    assert resolved.train_batch_size == 8 and resolved.optimizer.params["lr"] == 1e-4


def test_values_set_only_in_zero_are_adopted_by_training(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        zero:
          train_micro_batch_size_per_gpu: 4
          gradient_accumulation_steps: 2
          gradient_clipping: 0.0
          fp16: {enabled: true}
          optimizer: {type: AdamW, params: {lr: 1.0e-4, betas: [0.9, 0.999], weight_decay: 0.1}}
          scheduler: {type: WarmupDecayLR, params: {total_num_steps: 77, warmup_num_steps: 7}}
        """))
    cfg = load_train_config(run)
    t = cfg.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.grad_clip) == (4, 2, 0.0)
    assert (t.lr, t.betas, t.weight_decay, t.eps) == (1e-4, (0.9, 0.999), 0.1, 1e-8)
    assert (t.max_steps, t.warmup_steps, t.lr_schedule, t.precision) == (77, 7, "linear", "fp16")
    assert "training.micro_batch_size = 4, taken from zero.train_micro_batch_size_per_gpu" in "\n".join(cfg.notes)
    resolved, notes = engine(cfg, world_size=2, total_steps=t.max_steps)
    assert resolved.train_batch_size == 16 and resolved.fp16.enabled is True
    assert resolved.scheduler.params["warmup_max_lr"] == 1e-4 and notes == cfg.notes


def test_zero_flags_win_over_the_built_in_defaults_but_not_over_training_flags(tmp_path, monkeypatch):
    write(tmp_path / "ds.json", '{"zero_optimization": {"stage": 1}, // comment\n "train_micro_batch_size_per_gpu": 2}')
    monkeypatch.chdir(tmp_path)  # --zero PATH is relative to the working directory
    cfg = load_train_config(None, ["--model.path", "d", "--zero=ds.json", "--zero.gradient_clipping", "0.3"])
    assert (cfg.model.path, cfg.model.architecture) == ("d", None)
    assert cfg.zero == {
        "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.3}
    assert (cfg.training.micro_batch_size, cfg.training.grad_clip) == (2, 0.3)
    default = load_train_config(None).training  # the default's other values are kept
    assert cfg.training.model_dump(exclude={"micro_batch_size", "grad_clip"}) == default.model_dump(
        exclude={"micro_batch_size", "grad_clip"})
    assert cfg.training.model_fields_set == {"micro_batch_size", "grad_clip"}
    message = error_of(load_train_config, None, ["--zero.gradient_clipping", "0.3", "--training.grad_clip", "1"])
    assert "zero.gradient_clipping = 0.3 but training.grad_clip = 1.0" in message


def test_two_zero_keys_for_one_training_setting_must_agree(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        zero:
          optimizer: {type: AdamW, params: {lr: 1.0e-4}}
          scheduler: {type: WarmupLR, params: {warmup_max_lr: 2.0e-4}}
        """))
    message = error_of(load_train_config, run)
    assert "zero.scheduler.params.warmup_max_lr = 0.0002 but zero.optimizer.params.lr = 0.0001" in message


def test_train_batch_size_is_checked_against_the_world_size(tmp_path):
    run = write(tmp_path / "run.yaml", TINY + "training: {micro_batch_size: 4}\nzero: {train_batch_size: 16}\n")
    cfg = load_train_config(run)
    assert engine(cfg, world_size=4)[0].train_batch_size == 16
    message = error_of(engine, cfg, world_size=2)
    assert "zero.train_batch_size = 16 but training.micro_batch_size 4 × " in message and "world size 2 = 8" in message


def test_total_steps_from_epochs_must_match_an_explicit_total_num_steps(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {epochs: 2}
        zero: {scheduler: {type: WarmupCosineLR, params: {total_num_steps: 100}}}
        """))
    cfg = load_train_config(run)
    assert engine(cfg, total_steps=100)[0].scheduler.params["total_num_steps"] == 100
    message = error_of(engine, cfg, total_steps=60)
    assert "zero.scheduler.params.total_num_steps = 100 but training runs 60 steps (training.epochs = 2.0)" in message


def test_a_config_built_in_code_is_checked_too():
    cfg = TrainConfig(model={"architecture": "llama"}, training={"lr": 0.1}, zero={"optimizer": {
        "type": "AdamW", "params": {"lr": 0.2}}})
    assert "zero.optimizer.params.lr = 0.2 but training.lr = 0.1" in error_of(engine, cfg)


def test_deepspeed_activation_checkpointing_turns_on_the_models_gradient_checkpointing(tmp_path):
    from zerotrain.train.zero_fill import wants_gradient_checkpointing

    run = write(tmp_path / "run.yaml", with_model("""\
        zero:
          zero_optimization: {stage: 2}
          activation_checkpointing: {partition_activations: true, cpu_checkpointing: true}
        """))
    cfg = load_train_config(run)
    assert wants_gradient_checkpointing(cfg) and not cfg.training.gradient_checkpointing
    resolved, notes = engine(cfg, world_size=1, total_steps=10)  # not refused as an unbuilt feature
    assert any("activation_checkpointing" in n and "gradient checkpointing" in n for n in notes)
    assert not wants_gradient_checkpointing(load_train_config(None))


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
