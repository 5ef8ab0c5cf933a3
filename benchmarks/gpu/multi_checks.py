"""The multi-GPU part's verdicts: sharded training equals a world of one, and each rank holds its share.

* Losses: each step's loss of zerotrain stage s at world W (the mean over ranks: the global batch's)
  against plain torch and zerotrain stage s at world 1 on the same global batch, relative
  difference at most `rtol`. fp32; the rounding that differs is the order of the gradient sums
  (a W-way all-reduce against one batch) and the matmul kernels picked for the smaller per-rank
  shapes (cuBLAS picks by shape), carried through a few AdamW steps: about 1e-6 relative per
  step on 2 CPU ranks, so 1e-5 there; 1e-4 on GPUs (TF32 off, torch's default for fp32 matmuls).
* Memory: zerotrain's own count of what each rank holds (`engine.memory_breakdown()`: parameters,
  gradients, fp32 masters, optimizer state, measured from the tensors) at world W over world 1.
  What stage s shards must be at most 1/W of it (plus `slack` for the padding to a multiple of W);
  stage 1 shards master weights and optimizer state, stage 2 also gradients, stage 3 also parameters.
"""

from __future__ import annotations

SHARDED = {0: (), 1: ("master", "optimizer_state"), 2: ("master", "optimizer_state", "grads"),
           3: ("master", "optimizer_state", "grads", "params")}
LOSS_RTOL = {"cpu": 1e-5, "cuda": 1e-4}
MEMORY_SLACK = 0.05


def max_relative_difference(a: list[float], b: list[float]) -> float | None:
    """Largest |a - b| / |b| over the steps both have (None when either has none)."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n]))


def loss_verdict(stage: int, world_losses: list[float] | None, references: dict[str, list[float] | None],
                 rtol: float) -> dict:
    """{stage, against: {name: max relative difference}, ok, why}: every reference within rtol."""
    if world_losses is None:
        return {"stage": stage, "against": {}, "ok": False, "why": f"zerotrain-{stage} did not run at world W"}
    against, problems = {}, []
    for name, ref in references.items():
        diff = None if ref is None else max_relative_difference(world_losses, ref)
        against[name] = diff
        if diff is None:
            problems.append(f"no {name} losses to compare")
        elif diff > rtol:
            problems.append(f"{name}: {diff:.2e} > {rtol:.0e}")
    return {"stage": stage, "against": against, "ok": not problems, "why": "; ".join(problems) or None}


def memory_verdict(stage: int, world: int, one: dict[str, int] | None, by_rank: list[dict[str, int]] | None,
                   slack: float = MEMORY_SLACK) -> dict:
    """{stage, ranks: [{kind: ratio to world 1}], ok, why}: each rank's sharded kinds at most (1 + slack) / W."""
    if one is None or not by_rank:
        return {"stage": stage, "ranks": [], "ok": False, "why": "no memory breakdown at world 1 or at world W"}
    limit = (1 + slack) / world
    ranks, problems = [], []
    for rank, held in enumerate(by_rank):
        ratios = {k: (held.get(k, 0) / one[k] if one.get(k) else None) for k in ("params", "grads", "master",
                                                                                  "optimizer_state")}
        sharded_one = sum(one.get(k, 0) for k in SHARDED[stage])
        ratios["sharded"] = sum(held.get(k, 0) for k in SHARDED[stage]) / sharded_one if sharded_one else None
        ranks.append(ratios)
        for k in SHARDED[stage]:
            if ratios[k] is not None and ratios[k] > limit:
                problems.append(f"rank {rank} {k}: {ratios[k]:.3f} of world 1's (limit {limit:.3f})")
    if SHARDED[stage] and all(r["sharded"] is None for r in ranks):
        problems.append(f"world 1 holds none of {SHARDED[stage]}: nothing to compare")
    return {"stage": stage, "ranks": ranks, "ok": not problems, "why": "; ".join(problems) or None}
