"""Features not built yet: each is refused with a fix when switched on, and passes when off.

Offload is built: its settings pass, and they move the state (to the CPU, into files under
nvme_path), checked here on a bucket in this process and in a two-rank stage-3 run that
must train as it does without offload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from config_fixtures import error_of, resolve
from conftest import on_gpu, run_on_ranks
from in_process_gather import gather_over
from llama_workload import train_zerotrain, zero_config
from zerotrain.config import check_supported, load_config
from zerotrain.config.unsupported import NOT_YET_BUILT

CPU_OFFLOAD = {"cpu_offload": True, "offload_param": {"device": "cpu"}}  # DeepSpeed's old switch for the optimizer


def nvme_offload(path) -> dict:
    """Parameters and optimizer state on NVMe; no parameter shard cached in memory."""
    nvme = {"device": "nvme", "nvme_path": str(path)}
    return {"offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme}


def _offload_plan_of(zero_extra: dict, params: list[nn.Parameter]):
    from zerotrain.zero.offload_setup import offload_plan

    config = load_config({"zero_optimization": {"stage": 3, **zero_extra}})
    check_supported(config)
    return offload_plan(config.zero_optimization, [params], 1, 0, torch.float32)


@pytest.mark.parametrize(
    "data, setting",
    [
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
        ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint"),
        ({"amp": {"enabled": True}}, "amp"),
    ],
)
def test_unbuilt_feature_is_refused_with_a_fix(data, setting):
    message = error_of(check_supported, load_config(data))
    assert message.startswith(setting)
    assert "not built" in message


def test_unbuilt_feature_message_says_what_to_change():
    message = error_of(check_supported, load_config({"zero_optimization": {"zero_quantized_weights": True}}))
    assert "arrives with a later version" in message
    assert "set zero_optimization.zero_quantized_weights to false" in message


def test_elastic_checkpoint_is_accepted_as_a_no_op_and_said_once(caplog, monkeypatch):
    """zerotrain's checkpoints load at any world size and stage, which is what DeepSpeed's switch is for."""
    import logging

    from zerotrain.config import unsupported

    monkeypatch.setattr(unsupported, "_said", set())  # said once per process: as in one that has not said it
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        for _ in range(2):
            check_supported(load_config({"zero_optimization": {"elastic_checkpoint": True}}))
    notes = [r.getMessage() for r in caplog.records if "elastic_checkpoint" in r.getMessage()]
    assert notes == ["zero_optimization.elastic_checkpoint: true changes nothing in zerotrain: its checkpoints "
                     "always load at any world size and stage"]


def test_cpu_offload_is_built():
    params = list(nn.Linear(4, 3).parameters())
    plan = _offload_plan_of(CPU_OFFLOAD, params)
    cpu = torch.device("cpu")
    assert (plan.optimizer_device, plan.param_device) == (cpu, cpu)  # masters + state, and stage-3 shards
    assert plan.state_swap is None and plan.param_swap is None  # in memory, not in files
    plain = _offload_plan_of({}, params)
    assert (plain.optimizer_device, plain.param_device) == (None, None)  # on the compute device


def test_nvme_offload_is_built(tmp_path, monkeypatch):
    """A stage-3 bucket built with NVMe offload: its parameter shard and fp32 master leave memory
    for files under nvme_path, and come back as they were."""
    from zerotrain.zero.stage import StagePlan, build_flat_params

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    values = torch.cat([model.weight.detach().flatten(), model.bias.detach()]).clone()
    plan = _offload_plan_of(nvme_offload(tmp_path), list(model.parameters()))
    (fp,) = build_flat_params(model, [list(model.parameters())], StagePlan(3), 1000, torch.float32, 0, plan)
    gather_over(monkeypatch, [fp])  # a world of one
    stores = [plan.param_swap.store, plan.state_swap.store]
    for store in stores:
        store.wait_all()
        assert Path(store.directory).parent == tmp_path
    sizes = [[f.stat().st_size for f in Path(store.directory).iterdir()] for store in stores]
    assert sizes == [[15 * 4], [15 * 4]]  # one file each: the parameter shard, the master (15 fp32 values)
    assert fp.local_shard.untyped_storage().nbytes() == 0 and fp.master.untyped_storage().nbytes() == 0
    fp.gather()
    assert torch.equal(model.weight.detach(), values[:12].view(3, 4)) and torch.equal(model.bias.detach(), values[12:])
    with plan.state_swap.resident():
        assert torch.equal(fp.master, values)
    for store in stores:
        store.close()
    assert not any(tmp_path.iterdir())  # each store removes its folder


def _offload_runs(nvme_path: str) -> dict:
    """Three steps of stage 3 without offload, with CPU offload and with NVMe offload: for each,
    the losses, final weights and where the state lives after the last step."""
    runs = {}
    for name, extra in [("none", {}), ("cpu", CPU_OFFLOAD), ("nvme", nvme_offload(nvme_path))]:
        run = train_zerotrain(zero_config(3, 2, 1, **extra), steps=3)
        engine = run["engine"]
        stores = [engine.optimizer.nvme, engine.flat_params[0].swap] if name == "nvme" else []
        for swap in stores:
            swap.store.wait_all()
        state = [v for s in engine.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        runs[name] = {
            "losses": run["losses"], "weights": run["weights"], "compute": engine.device.type,
            "devices": {t.device.type for fp in engine.flat_params for t in (fp.master, fp.local_shard)}
                       | {t.device.type for t in state},
            "resident": engine.memory_breakdown(),
            "file_bytes": [sum(f.stat().st_size for f in Path(s.store.directory).iterdir()) for s in stores],
            "shard_elements": sum(fp.shard_size for fp in engine.flat_params),
        }
    return runs


@pytest.fixture(scope="module", params=["cpu", on_gpu("gpu", "gpu")])
def offload_runs(request, tmp_path_factory) -> list[dict]:
    world = 2 if request.param == "cpu" else 1
    return run_on_ranks(world, _offload_runs, str(tmp_path_factory.mktemp("nvme")), device=request.param)


def _assert_trains_as_without_offload(run: dict, plain: dict) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
    for name, weight in plain["weights"].items():
        assert (run["weights"][name] - weight).norm() <= 1e-5 * weight.norm(), name


@pytest.mark.slow
def test_cpu_offload_keeps_the_state_on_the_cpu_and_trains_as_without_it(offload_runs):
    for rank in offload_runs:
        assert rank["cpu"]["devices"] == {"cpu"}, rank["cpu"]["devices"]
        if rank["cpu"]["compute"] == "cuda":  # without offload the state is on the GPU
            assert rank["none"]["devices"] == {"cuda"}
        _assert_trains_as_without_offload(rank["cpu"], rank["none"])


@pytest.mark.slow
def test_nvme_offload_keeps_the_state_in_files_and_trains_as_without_it(offload_runs):
    for rank in offload_runs:
        run = rank["nvme"]
        held = {k: run["resident"][k] for k in ("params", "grads", "master", "optimizer_state")}
        assert held == dict.fromkeys(held, 0), run["resident"]  # between steps, all of it is in files
        assert rank["none"]["resident"]["optimizer_state"] > 0
        fp32 = 4 * run["shard_elements"]
        # optimizer store: master, exp_avg, exp_avg_sq and the gradient shard; parameter store: the shard
        assert run["file_bytes"] == [4 * fp32, fp32]
        _assert_trains_as_without_offload(run, rank["none"])


def test_switched_off_features_pass():
    check_supported(load_config({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "cpu_offload": False},
        "tensorboard": {"enabled": False, "output_path": "/tmp"},
        "checkpoint": {"tag_validation": "Warn"},
        "amp": {"enabled": False},
        "dataloader_drop_last": False,
    }))


def test_every_unbuilt_feature_row_is_off_by_default():
    default = load_config({})
    assert all(row.requested(default) is None for row in NOT_YET_BUILT)


def test_resolve_refuses_unbuilt_features_first():
    data = {
        "zero_optimization": {"zero_quantized_weights": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    assert "ZeRO++ quantized weights is not built yet" in error_of(resolve, data)


def test_hugging_face_amp_auto_counts_as_off():
    cfg = resolve({"train_batch_size": 8, "amp": {"enabled": "auto", "opt_level": "auto"}})
    assert cfg.other_deepspeed_keys == {}
