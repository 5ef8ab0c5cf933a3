"""ZEROTRAIN_FAULT is the one fault injection in zerotrain: one parser, actions for every test that
needs a failure (kill, stop, out of memory, a failure), numbered points for steps, trials, stages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from zerotrain.comm import fault_points
from zerotrain.comm.fault_points import FAULT_ENV, fault_point, parse_fault

PACKAGE = Path(fault_points.__file__).resolve().parents[1]


def test_product_code_has_no_test_hook_but_zerotrain_fault():
    hooks = sorted(f"{p.relative_to(PACKAGE.parent)}: {m}" for p in PACKAGE.rglob("*.py")
                   for m in set(re.findall(r"ZEROTRAIN_TEST_\w+", p.read_text())))
    assert not hooks, "test hooks outside ZEROTRAIN_FAULT (zerotrain/comm/fault_points.py):\n" + "\n".join(hooks)


def test_a_value_parses_with_kill_and_the_first_arrival_by_default():
    assert parse_fault("forward:rank1") == ("forward", "rank1", 1, "kill")
    assert parse_fault("trial:rank0:2:fail") == ("trial", "rank0", 2, "fail")
    assert parse_fault("verify:rank1:0:oom").n == 0  # a numbered point: ZeRO stage 0


@pytest.mark.parametrize("spec, says", [
    ("forward", "expected POINT:VICTIM"),
    ("nowhere:rank0", "unknown point 'nowhere'; points: forward"),
    ("forward:rankX", "unknown victim 'rankX'"),
    ("forward:rank0:1:explode", "unknown action 'explode'; actions: kill, stop, oom, fail"),
    ("forward:launcher:1:oom", "the launcher can only be killed or stopped"),
    ("forward:rank0:two", "N must be a whole number, not 'two'"),
    ("forward:rank0:0", "N counts arrivals at forward from 1"),
])
def test_a_wrong_value_says_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_fault(spec)


def test_oom_and_fail_raise_in_the_victim_only_at_its_numbered_point(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(FAULT_ENV, "trial:rank1:2:oom")
    fault_point("trial", number=1)  # another trial: nothing
    fault_point("forward")  # another point: nothing
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        fault_point("trial", number=2)
    with pytest.raises(torch.OutOfMemoryError):
        fault_point("trial", number=2)  # a numbered point fires every time it carries N (a repeat)
    monkeypatch.setenv(FAULT_ENV, "verify:rank1:0:fail")
    with pytest.raises(ValueError, match=r"^injected failure \(by a test\) at verify .*\nsecond line"):
        fault_point("verify", number=0)
    monkeypatch.setenv(FAULT_ENV, "verify:rank0:0:fail")
    fault_point("verify", number=0)  # rank 0 is not the victim


def test_counted_points_fire_at_the_nth_arrival(monkeypatch):
    monkeypatch.setattr(fault_points, "_arrivals", {})
    monkeypatch.setenv(FAULT_ENV, "after_shards:all:3:fail")
    fault_point("after_shards")
    fault_point("after_shards")
    with pytest.raises(ValueError, match="injected failure"):
        fault_point("after_shards")
    fault_point("after_shards")  # the 4th: past it
