"""Whatever is killed, whenever: the newest complete checkpoint resumes the run that would have happened.

One moment of each kind here (`make soak` runs them all, with every victim, at random arrivals):
each trial kills a 2-rank `zerotrain train` job at a named fault point, resumes it, and checks
`latest`, leftover processes and files, and the losses against the uninterrupted run, bitwise
(tests/faults/crash_run.py says exactly what).
"""

from __future__ import annotations

import pytest

from faults.crash_run import reference, run_trial

pytestmark = pytest.mark.slow

# (stage, point, victim, arrival): a moment inside a step and one inside a save, on one reference run;
# the launcher is the last test's victim. `make soak` runs every moment (NVMe writes too), victim and stage.
CASES = [
    (1, "backward", "rank1", 3),
    (1, "before_latest", "rank0", 2),
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference losses per (stage, nvme), computed once for the module."""
    tmp = tmp_path_factory.mktemp("reference")
    cache: dict = {}

    def losses(stage: int, nvme: bool):
        if (stage, nvme) not in cache:
            cache[stage, nvme] = reference(tmp, stage, nvme)
        return cache[stage, nvme]

    return losses


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage, point, victim, n", CASES, ids=[f"{p}-{v}-stage{s}" for s, p, v, _ in CASES])
def test_a_kill_at_any_moment_resumes_to_the_uninterrupted_losses(tmp_path, uninterrupted, stage, point, victim, n):
    trial = run_trial(tmp_path, stage, point, victim, n, uninterrupted(stage, point == "nvme_write"))
    assert not trial.problems, trial.problems
    assert trial.killed and trial.equal and trial.resumed_from


@pytest.mark.timeout(600)
def test_a_detached_runs_launcher_killed_stops_its_ranks_and_resumes(tmp_path, uninterrupted):
    # The second forward: the ranks, which notice within half a second, still have most steps to stop in.
    trial = run_trial(tmp_path, 1, "forward", "launcher", 2, uninterrupted(1, False), detach=True)
    assert not trial.problems, trial.problems
