"""`make soak`: kill a short training job at every fault point, with every victim, at every stage, at
randomized arrivals; resume each; print the table of kills, resumes, bitwise-equal continuations and
leftovers. Exit status 1 if any trial found a problem (each is listed).

    python tests/faults/soak.py [--rounds 3] [--seed 0] [--parallel 2] [--out soak.json]

Each trial is tests/faults/crash_run.py's: ~20 s on 2 CPU cores. Three rounds are 138 kills.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crash_run import ARRIVALS, reference, run_trial  # noqa: E402

STAGES = (1, 3)
VICTIMS = ("rank0", "rank1", "all", "launcher")
RANK0_ONLY = {"before_latest"}  # only rank 0 reaches it: rank 1 is never there to be killed


def plan(rounds: int, seed: int) -> list[tuple[int, str, str, int, bool]]:
    """(stage, point, victim, arrival, detach) for every trial, arrivals drawn from `seed`."""
    draw = random.Random(seed)
    trials = []
    for _ in range(rounds):
        for stage in STAGES:
            for point, arrivals in ARRIVALS.items():
                for victim in VICTIMS:
                    if point in RANK0_ONLY and victim == "rank1":
                        continue
                    detach = victim == "launcher" and draw.random() < 0.5
                    trials.append((stage, point, victim, draw.randint(1, arrivals), detach))
    return trials


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=2, help="trials at once (each runs 2 ranks)")
    p.add_argument("--out", type=Path, default=None, help="write every trial's record here (JSON)")
    args = p.parse_args(argv)
    trials = plan(args.rounds, args.seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotrain-soak-") as folder:
        tmp = Path(folder)
        expected = {(s, n): reference(tmp, s, n) for s in STAGES for n in (False, True)}
        print(f"soak: {len(trials)} kills, {args.parallel} at a time; references done in {time.monotonic() - t0:.0f} s",
              flush=True)

        def one(index: int, spec) -> dict:
            stage, point, victim, n, detach = spec
            trial_dir = tmp / f"t{index:03d}"
            trial_dir.mkdir()
            result = asdict(run_trial(trial_dir, stage, point, victim, n, expected[stage, point == "nvme_write"],
                                      detach))
            mark = "ok" if not result["problems"] else "PROBLEM: " + "; ".join(result["problems"])[:300]
            print(f"[{time.monotonic() - t0:6.0f} s] {index + 1}/{len(trials)} stage {stage} {point}:{victim}:{n}"
                  f"{' detached' if detach else ''}: {mark}", flush=True)
            return result

        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(lambda item: one(*item), enumerate(trials)))
    rows = Counter()
    print(f"\n{'stage':<6}{'point':<16}{'kills':>6}{'resumed':>9}{'bitwise equal':>15}{'leftovers':>11}{'problems':>10}")
    for stage in STAGES:
        for point in ARRIVALS:
            mine = [r for r in results if r["stage"] == stage and r["point"] == point]
            kills = sum(r["killed"] for r in mine)
            resumed = sum(bool(r["resumed_from"]) for r in mine)
            equal = sum(r["equal"] for r in mine)
            left = sum(bool(r["leftovers"]) for r in mine)
            bad = sum(bool(r["problems"]) for r in mine)
            rows.update(kills=kills, resumed=resumed, equal=equal, left=left, bad=bad, trials=len(mine))
            print(f"{stage:<6}{point:<16}{kills:>6}{resumed:>9}{equal:>15}{left:>11}{bad:>10}")
    print(f"{'all':<22}{rows['kills']:>6}{rows['resumed']:>9}{rows['equal']:>15}{rows['left']:>11}{rows['bad']:>10}")
    print(f"{len(results)} trials in {time.monotonic() - t0:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    for r in results:
        if r["problems"]:
            print(f"stage {r['stage']} {r['point']}:{r['victim']}:{r['n']}: {r['problems']}")
    return 1 if rows["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
