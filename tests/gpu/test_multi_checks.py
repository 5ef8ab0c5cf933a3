"""The multi-GPU part's verdicts (benchmarks/gpu/multi_checks.py) on made-up figures: sharded
training must equal a world of one, and each rank must hold its share of what its stage shards."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "gpu"))

from multi_checks import loss_verdict, memory_verdict  # noqa: E402

ONE = {"params": 1000, "grads": 1000, "master": 0, "optimizer_state": 2000}  # fp32: the masters are the params


def test_losses_within_the_tolerance_pass_and_one_step_beyond_it_fails():
    ref = [5.0, 4.0, 3.0]
    assert loss_verdict(2, [5.0, 4.0 * (1 + 5e-6), 3.0], {"plain": ref}, 1e-5)["ok"]
    bad = loss_verdict(2, [5.0, 4.0, 3.0 * (1 + 3e-5)], {"plain": ref, "zerotrain-2": ref}, 1e-5)
    assert not bad["ok"] and "plain: 3.00e-05 > 1e-05" in bad["why"] and "zerotrain-2" in bad["why"]


def test_a_missing_run_is_a_failure_not_a_pass():
    assert not loss_verdict(3, None, {"plain": [1.0]}, 1e-5)["ok"]
    assert not loss_verdict(3, [1.0], {"plain": None}, 1e-5)["ok"]
    assert not memory_verdict(3, 2, ONE, None)["ok"]


def test_each_stage_must_halve_what_it_shards_on_every_rank():
    half_opt = {"params": 1000, "grads": 1000, "master": 0, "optimizer_state": 1000}
    assert memory_verdict(1, 2, ONE, [half_opt, half_opt])["ok"]
    assert memory_verdict(0, 2, ONE, [ONE, ONE])["ok"]  # stage 0 shards nothing
    # stage 2 also shards gradients: whole gradients on rank 1 fail it, and name the rank
    bad = memory_verdict(2, 2, ONE, [{**half_opt, "grads": 500}, half_opt])
    assert not bad["ok"] and bad["why"].startswith("rank 1 grads: 1.000")
    third = {"params": 334, "grads": 334, "master": 0, "optimizer_state": 667}  # padding within the slack
    verdict = memory_verdict(3, 3, ONE, [third] * 3)
    assert verdict["ok"] and abs(verdict["ranks"][0]["sharded"] - 1335 / 4000) < 1e-9
    assert not memory_verdict(3, 2, ONE, [half_opt, half_opt])["ok"]  # stage 3 left params and grads whole
