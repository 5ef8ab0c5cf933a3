"""The long-sequence part's search and verdicts (benchmarks/gpu/longseq_search.py, longseq_report.py),
driven by made-up trials: no process is started."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "gpu"))

from longseq_report import prediction_target, ratio_target  # noqa: E402
from longseq_search import LengthSearch  # noqa: E402


def _run(search: LengthSearch, limit: int, step_s=lambda seq: 1.0) -> list[int]:
    """Drives `search` with a fake GPU that trains every length up to `limit` and is out of memory past it."""
    tried = []
    while (seq := search.next_length()) is not None:
        tried.append(seq)
        ok = seq <= limit
        search.trials.append({"seq": seq, "status": "ok" if ok else "failed", "reason": None if ok else "CUDA OOM",
                              "wall_s": 10 + 3 * step_s(seq), "step_s": [step_s(seq)] * 3, "median_step_s": step_s(seq)})
    return tried


def test_the_search_doubles_to_the_first_out_of_memory_then_bisects_to_a_sixteenth():
    search = LengthSearch("s", "plain", start=4096, grain=1024, cap=1 << 22)
    tried = _run(search, limit=50_000)
    assert tried[:5] == [4096, 8192, 16384, 32768, 65536]  # doubling until the first OOM
    assert search.done == "boundary found" and search.bounded_by_memory()
    assert search.longest_ok() <= 50_000 < search.shortest_memory_failure()
    assert search.shortest_memory_failure() - search.longest_ok() <= 50_000 // 16


def test_a_start_that_runs_out_of_memory_halves_and_the_cap_ends_a_search():
    search = LengthSearch("s", "plain", start=16384, grain=1024, cap=1 << 22)
    assert _run(search, limit=3000)[:4] == [16384, 8192, 4096, 2048]
    assert search.longest_ok() in (2048, 3072) and search.bounded_by_memory()
    capped = LengthSearch("s", "alst", start=1024, grain=1024, cap=4096)
    assert _run(capped, limit=10**9) == [1024, 2048, 4096] and capped.done == "cap reached"
    assert not capped.bounded_by_memory()


def test_a_length_predicted_past_the_time_left_is_not_tried_and_named():
    search = LengthSearch("s", "alst", start=1024, grain=1024, cap=1 << 22)
    for seq in (1024, 2048):  # steps of 1 s and 4 s: all quadratic; 10 s start-up
        search.trials.append({"seq": seq, "status": "ok", "wall_s": 10 + 3 * (seq / 1024) ** 2,
                              "step_s": [(seq / 1024) ** 2] * 3, "median_step_s": (seq / 1024) ** 2})
    assert search.next_length() == 4096
    assert abs(search.predicted_wall_s(4096) - (10 + 3 * 16)) < 1e-6
    assert search.fits_in(4096, 60.0)
    assert not search.fits_in(4096, 50.0) and search.done == "time"
    assert search.not_tried == [{"seq": 4096, "predicted_wall_s": 58.0, "seconds_left": 50.0}]
    assert search.next_length() is None


def test_a_trial_that_fails_for_another_reason_than_memory_ends_the_search():
    search = LengthSearch("s", "plain", start=1024, grain=1024, cap=1 << 22)
    search.trials.append({"seq": 1024, "status": "failed", "reason": "timeout"})
    assert search.next_length() is None and search.done == "time"
    broken = LengthSearch("s", "plain", start=1024, grain=1024, cap=1 << 22)
    broken.trials.append({"seq": 1024, "status": "failed", "reason": "error"})
    assert broken.next_length() is None and broken.done == "stopped: error"


def _found(longest, bounded, stopped="boundary found", predicted=0):
    return {"longest": longest, "bounded_by_memory": bounded, "stopped": stopped, "predicted_max": predicted}


def test_the_8x_target_needs_plains_memory_limit_and_is_missed_only_at_alsts():
    assert ratio_target(_found(10_000, True), _found(80_000, False, "time"))["verdict"] == "met"  # a lower bound is enough
    assert ratio_target(_found(10_000, True), _found(70_000, True))["verdict"] == "missed"
    assert ratio_target(_found(10_000, True), _found(70_000, False, "time"))["verdict"] == "not shown"
    assert ratio_target(_found(10_000, False, "time"), _found(90_000, True))["verdict"] == "not shown"
    assert ratio_target(_found(None, False), _found(90_000, True))["verdict"] == "not shown"


def test_the_prediction_target_is_ten_percent_of_a_measured_memory_limit():
    assert prediction_target(_found(100_000, True, predicted=109_000)) == {"error": 0.09, "verdict": "met"}
    assert prediction_target(_found(100_000, True, predicted=89_000))["verdict"] == "missed"
    assert prediction_target(_found(100_000, False, "time", predicted=100_000))["verdict"] == "not shown"


def test_before_its_own_first_trial_a_search_predicts_time_from_its_reference():
    plain = [{"seq": 1024, "status": "ok", "wall_s": 13.0, "step_s": [1.0] * 3, "median_step_s": 1.0}]
    alst = LengthSearch("s", "alst", start=8192, grain=1024, cap=1 << 22, reference=plain)
    assert alst.next_length() == 8192 and alst.predicted_wall_s(8192) == 10 + 3 * 64.0
    assert not alst.fits_in(8192, 100.0) and alst.not_tried[0]["seq"] == 8192
