"""The size check's verdict on one trial (benchmarks/gpu/size_launch.py), without running one."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "gpu"))

import size_launch  # noqa: E402
from size_ladder import ladder  # noqa: E402
from size_search import Search  # noqa: E402
from size_watch import Watched  # noqa: E402


def _trial(tmp_path, monkeypatch, child: dict | None, killed: str | None):
    def fake_watch(cmd, env, log, timeout_s, floor, rss_limit, baseline):
        log.write_text("trial output\n")
        if child is not None:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(child))
        return Watched(-9 if killed else 0, killed, 12.0)

    monkeypatch.setattr(size_launch, "run_watched", fake_watch)
    sizes = ladder(dry=True, top=2)
    limits = size_launch.Limits(floor_bytes=1, host_limit_bytes=2**30, rss_limit_bytes=None, trial_timeout_s=10)
    return size_launch.run_trial(Search("zero2-offload-opt", "zerotrain", sizes, 1), sizes[0], python=sys.executable,
                                 cuda=True, threads=1, seq=64, steps=3, stage3_build="device", limits=limits,
                                 timeout_s=10, log_dir=tmp_path, budget_cut=False)


def test_a_trial_that_wrote_its_result_counts_even_when_its_exit_is_cut_by_the_timeout(tmp_path, monkeypatch):
    record = _trial(tmp_path, monkeypatch, {"status": "ok", "tokens_per_s": 57.5, "step_s": [38.8, 34.0, 37.2]},
                    killed="timeout (10 s)")
    assert record["status"] == "ok" and record["tokens_per_s"] == 57.5
    assert "killed while exiting" in record["detail"]


@pytest.mark.parametrize("killed, reason", [("timeout (10 s)", "timeout"),
                                            ("host memory exceeded: MemAvailable 3.0 GiB < floor 3.1 GiB",
                                             "host memory")])
def test_a_trial_killed_before_its_result_fails_with_the_reason(tmp_path, monkeypatch, killed, reason):
    record = _trial(tmp_path, monkeypatch, None, killed=killed)
    assert (record["status"], record["reason"]) == ("failed", reason)


def test_a_host_memory_kill_after_the_result_still_fails(tmp_path, monkeypatch):
    record = _trial(tmp_path, monkeypatch, {"status": "ok"}, killed="host memory exceeded: MemAvailable low")
    assert (record["status"], record["reason"]) == ("failed", "host memory")
