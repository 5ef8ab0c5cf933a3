"""The verdict of `zerotrain tune` from made-up measurements: a winner only when its spread is clear of
the others', "within noise" otherwise; which trials run again; the train YAML overrides of a winner."""

from __future__ import annotations

import shlex

import yaml

from zerotrain.autotuning.apply import apply_lines, winner_overrides
from zerotrain.autotuning.noise import Spread, to_repeat, verdict
from zerotrain.autotuning.results import samples_of


def test_overlapping_spreads_are_within_noise_and_name_no_winner():
    # The machine: one configuration measured 552 and 678 samples/s.
    samples = {"z0_mbs4": [552.0, 678.0, 640.0], "z0_mbs2": [600.0, 610.0, 590.0], "z1_mbs4": [300.0, 310.0]}
    v = verdict(samples, "throughput")
    assert v.winner == "z0_mbs4" and v.within_noise == ("z0_mbs4", "z0_mbs2")
    assert v.text.startswith("z0_mbs4 and z0_mbs2 are within noise (spreads overlap): pick either; z0_mbs4 listed "
                             "first because its median is higher (640 vs 600 samples/s)"), v.text
    assert "winner" not in v.text and "ahead" not in v.text


def test_separated_spreads_name_the_winner_and_its_lead():
    samples = {"z0_mbs2": [600.0, 620.0, 610.0], "z0_mbs4": [700.0, 720.0, 690.0]}
    v = verdict(samples, "throughput")
    assert v.winner == "z0_mbs4" and not v.within_noise and v.measured
    assert v.text == "winner z0_mbs4: median 700 samples/s, ahead of z0_mbs2 by 15% (outside both spreads)"


def test_latency_lower_wins_and_single_runs_are_not_called_outside_the_noise():
    v = verdict({"a": [0.020, 0.021], "b": [0.010, 0.011]}, "latency")
    assert v.winner == "b" and "ahead of a by 49%" in v.text and "outside both spreads" in v.text
    one_run = verdict({"a": [600.0], "b": [700.0]}, "throughput")
    assert one_run.winner == "b" and not one_run.measured
    assert "single run" in one_run.text and "outside both spreads" not in one_run.text
    assert verdict({}, "throughput").winner is None
    assert "only trial" in verdict({"a": [1.0, 2.0]}, "throughput").text


def test_equal_medians_keep_the_trial_order_and_say_why():
    v = verdict({"first": [100.0, 110.0], "second": [105.0, 105.0]}, "throughput")
    assert v.within_noise == ("first", "second") and "trial order" in v.text


def test_the_leader_and_close_runners_up_are_repeated_until_the_lead_is_clear():
    # One run each: 640 and 600 are within the assumed +-10%, 300 is not; the runner-up is repeated anyway.
    first = {"a": [600.0], "b": [640.0], "c": [300.0]}
    assert to_repeat(first, "throughput", limit=3) == ["b", "a"]
    far = {"a": [1000.0], "b": [300.0]}
    assert to_repeat(far, "throughput", limit=3) == ["a", "b"]  # measure both spreads once
    settled = {"a": [600.0, 610.0], "b": [700.0, 705.0], "c": [300.0]}
    assert to_repeat(settled, "throughput", limit=3) == []
    noisy = {"a": [552.0, 678.0], "b": [600.0, 640.0]}
    assert to_repeat(noisy, "throughput", limit=3) == ["b", "a"]
    assert to_repeat({"a": [552.0, 678.0, 600.0], "b": [600.0, 640.0, 620.0]}, "throughput", limit=3) == []
    assert to_repeat({"a": [1.0]}, "throughput", limit=3) == []


def test_the_table_columns_come_from_every_run():
    records = [{"name": "a", "status": "ok", "metrics": {"throughput": 2.0},
                "runs": [{"throughput": 1.0}, {"throughput": 2.0}, {"throughput": 3.0}]},
               {"name": "b", "status": "oom", "reason": "rank 0: oom"}]
    assert samples_of(records, "throughput") == {"a": [1.0, 2.0, 3.0]}
    assert Spread("a", (1.0, 2.0, 3.0)).text() == "1-3 (+-50%)" and Spread("a", (5.0,)).text() == "5 (1 run)"


def test_the_overrides_turn_the_train_yaml_into_the_winner(tmp_path):
    from zerotrain.train.config_files import load_train_config

    base_zero = {"train_micro_batch_size_per_gpu": 8,
                 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": "llama"}, "training": {"micro_batch_size": 8}, "zero": base_zero}))
    winner = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    pairs, removals = winner_overrides(winner, True, base_zero)
    assert ("zero.zero_optimization.offload_param", None) in pairs and not removals
    lines = apply_lines("z2_oocpu_ckpt_mbs2", "t.yaml", pairs, removals, "autotuning_results/ds_config_optimal.json")
    assert "  training.micro_batch_size: 2" in lines and "  zero.zero_optimization.stage: 2" in lines
    command = next(line for line in lines if "zerotrain train" in line).split(": ", 1)[1]
    overrides = shlex.split(command)[3:]
    cfg = load_train_config(tmp_path / "t.yaml", overrides)
    assert (cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps) == (2, 4)
    assert cfg.training.gradient_checkpointing is True
    zero = cfg.zero_dict()
    assert zero["train_micro_batch_size_per_gpu"] == 2
    assert zero["zero_optimization"] == {"stage": 2, "offload_param": None,
                                         "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    _, removals = winner_overrides(winner, False, {"activation_checkpointing": {}})
    assert removals and removals[0].startswith("zero.activation_checkpointing")
