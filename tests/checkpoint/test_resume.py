"""Stop anywhere, go on exactly: resume equality and resharding across world sizes and stages.

On a GPU (`gpu-*` cases): resume on a world of 1 over NCCL, and checkpoints moved between a CPU
world of 2 and the GPU, in both directions, and between stages on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import on_gpu, run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config

K, M = 3, 3  # steps before the checkpoint, steps after it


def _config(stage: int, world: int, gas: int, dtype: str = "fp32") -> dict:
    cfg = zero_config(stage, world, gas, dtype)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10, "warmup_max_lr": 1e-2}}
    if dtype == "fp16":
        # a window longer than K, so the checkpoint lands mid-window
        cfg["fp16"].update(loss_scale_window=4, hysteresis=2)
    return cfg


def _segment(config: dict, first: int, last: int, load_dir=None, save_dir=None) -> dict:
    """Trains steps [first, last) on this rank, optionally loading before and saving after."""
    import torch.distributed as dist

    import zerotrain

    model = make_model(seed=123 if load_dir else 0)  # a resumed run must not depend on its own init
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    if load_dir:
        path, client = engine.load_checkpoint(load_dir)
        assert client == {"data_position": first}, client
        assert engine.global_steps == first
    world, rank = dist.get_world_size(), dist.get_rank()
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(first, last):
        ids = global_batch(step)
        for m in range(gas):
            chunk = ids[(m * world + rank) * micro :][:micro].to(engine.device)
            loss = engine(input_ids=chunk, labels=chunk).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    if save_dir:
        engine.save_checkpoint(save_dir, client_state={"data_position": last})
    scale = engine.optimizer.cur_scale
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    return {
        "losses": losses,
        "weights": weights,
        "lr": engine.get_lr(),
        "scale": scale,
        "skipped": engine.skipped_steps,
    }


CASES = [
    (0, 1, "fp32"), (1, 1, "fp32"), (2, 1, "fp32"), (3, 1, "fp32"),
    (1, 2, "fp32"), (2, 2, "fp32"), (3, 2, "fp32"), (2, 1, "fp16"), (3, 1, "bf16"),
]
RESUME_WORLD = 2


def _run_all(jobs: list[tuple]) -> list[dict]:
    """Several segments one after another in the same ranks (spawning is the slow part)."""
    return [_segment(*job) for job in jobs]


@pytest.fixture(scope="module", params=[pytest.param((RESUME_WORLD, "cpu"), marks=pytest.mark.slow), on_gpu((1, "gpu"), "gpu-world1")],
                ids=lambda p: f"world{p[0]}")
def resume_runs(request, tmp_path_factory):
    """Per case: an uninterrupted run, and a run stopped after K steps then resumed in new processes."""
    world, device = request.param
    root = tmp_path_factory.mktemp("resume")
    configs = [_config(s, world, g, d) for s, g, d in CASES]
    first = [(cfg, 0, K + M) for cfg in configs] + [(cfg, 0, K, None, str(root / str(i))) for i, cfg in enumerate(configs)]
    whole = run_on_ranks(world, _run_all, first, device=device)
    resumed = run_on_ranks(world, _run_all, [(cfg, K, K + M, str(root / str(i))) for i, cfg in enumerate(configs)],
                           device=device)
    return {case: ([w[i] for w in whole], [r[i] for r in resumed]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-accum{g}-{d}" for s, g, d in CASES])
def test_resumed_run_equals_uninterrupted_run_bitwise(resume_runs, case):
    whole, resumed = resume_runs[case]
    gas = case[1]
    for w, r in zip(whole, resumed):
        assert r["losses"] == w["losses"][K * gas :], "losses after resume differ"
        for name, t in w["weights"].items():
            assert torch.equal(r["weights"][name], t), f"{name} differs after resume"
        assert r["lr"] == w["lr"] and r["scale"] == w["scale"] and r["skipped"] == w["skipped"]


# (world, stage, device) saved -> (world, stage, device) loaded
RESHARD = [((4, 2), (2, 2)), ((2, 2), (1, 0)), ((2, 2), (2, 0)), ((2, 1), (4, 2)), ((2, 2), (2, 3)), ((4, 3), (1, 0))]
RESHARD = [((*a, "cpu"), (*b, "cpu")) for a, b in RESHARD]
RESHARD_GPU = [((2, 2, "cpu"), (1, 3, "gpu")), ((1, 3, "gpu"), (1, 0, "gpu")), ((1, 1, "gpu"), (2, 2, "cpu"))]


def _reshard_id(before, after) -> str:
    def side(world, stage, device):
        return f"{'gpu-' if device == 'gpu' else ''}world{world}-stage{stage}"

    return f"{side(*before)}-to-{side(*after)}"


@pytest.fixture(scope="module")
def reshard_groups() -> dict:
    """Each group's results, computed on its first case (an indirect parameter repeated across cases
    would otherwise rebuild a module-scoped fixture for every case)."""
    return {}


@pytest.fixture
def reshard_runs(request, reshard_groups, tmp_path_factory):
    """The results of the test's group ("cpu" or "gpu", an indirect parameter)."""
    if request.param not in reshard_groups:
        reshard_groups[request.param] = _reshard_group(request.param, tmp_path_factory)
    return reshard_groups[request.param]


def _reshard_group(group: str, tmp_path_factory) -> dict:
    """Saves at (N, s), goes on at (N, s) as the reference, and at (M, t) from the same checkpoint,
    for the cases of one group ("cpu": RESHARD, "gpu": RESHARD_GPU).

    Jobs are grouped by (world size, device) so that each is spawned once per phase.
    """
    cases = RESHARD_GPU if group == "gpu" else RESHARD
    root = tmp_path_factory.mktemp("reshard")
    ckpt = {before: str(root / f"w{before[0]}s{before[1]}{before[2]}") for before, _ in cases}
    jobs: dict[tuple, list] = {}
    for (n, s, dev), path in ckpt.items():
        jobs.setdefault((n, dev), []).append(("save", (n, s, dev), (_config(s, n, 1), 0, K, None, path)))
        jobs[(n, dev)].append(("go_on", (n, s, dev), (_config(s, n, 1), K, K + M, path)))
    results: dict = {}
    for n, dev in sorted(jobs, reverse=True):
        out = run_on_ranks(n, _run_all, [job for _, _, job in jobs[(n, dev)]], device=dev)
        for i, (kind, key, _) in enumerate(jobs[(n, dev)]):
            results[(kind, key)] = [rank[i] for rank in out]
    moved_jobs: dict[tuple, list] = {}
    for before, (m, t, dev) in cases:
        moved_jobs.setdefault((m, dev), []).append(((before, (m, t, dev)), (_config(t, m, 1), K, K + M, ckpt[before])))
    for (m, dev), items in moved_jobs.items():
        out = run_on_ranks(m, _run_all, [job for _, job in items], device=dev)
        for i, (key, _) in enumerate(items):
            results[("moved", key)] = [rank[i] for rank in out]
    return results


def _global_losses(ranks: list[dict]) -> list[float]:
    return [sum(step) / len(ranks) for step in zip(*[r["losses"] for r in ranks])]


@pytest.mark.parametrize(
    "reshard_runs,before,after",
    [pytest.param("cpu", a, b, id=_reshard_id(a, b), marks=pytest.mark.slow) for a, b in RESHARD]
    + [pytest.param("gpu", a, b, id=_reshard_id(a, b), marks=pytest.mark.cuda) for a, b in RESHARD_GPU],
    indirect=["reshard_runs"],
)
def test_checkpoint_loads_at_another_world_size_and_stage(reshard_runs, before, after):
    go_on = reshard_runs[("go_on", before)]
    moved = reshard_runs[("moved", (before, after))]
    torch.testing.assert_close(torch.tensor(_global_losses(moved)), torch.tensor(_global_losses(go_on)), rtol=1e-5, atol=1e-6)
    for name, t_ref in go_on[0]["weights"].items():
        err = (moved[0]["weights"][name] - t_ref).norm() / t_ref.norm()
        assert err <= 1e-5, f"{name}: relative difference {err:.2e}"
