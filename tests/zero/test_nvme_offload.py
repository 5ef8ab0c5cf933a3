"""With offload_optimizer on NVMe the files hold the state: none of it stays in memory between steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config
from zerotrain.config import ConfigError


def _train_and_look(nvme_path: str) -> dict:
    import torch.distributed as dist

    import zerotrain

    model = make_model()
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    cfg = zero_config(3, 2, 1, offload_optimizer=nvme, sub_group_size=3000)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    micro, rank = engine.train_micro_batch_size_per_gpu(), dist.get_rank()
    for step in range(3):
        ids = global_batch(step)[rank * micro :][:micro]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.optimizer.nvme.store.wait_all()
    files = [p for p in Path(engine.optimizer.nvme.store.directory).iterdir()]
    shard_elements = sum(fp.shard_size for fp in engine.flat_params)
    return {
        "resident": engine.memory_breakdown(),
        "file_bytes": sum(p.stat().st_size for p in files),
        "state_bytes": 12 * shard_elements,  # fp32 master + exp_avg + exp_avg_sq
        "grad_norm": engine.get_global_grad_norm(),
    }


def test_master_and_optimizer_state_live_in_files_between_steps(tmp_path):
    for r in run_on_ranks(2, _train_and_look, str(tmp_path)):
        assert r["resident"]["master"] == 0 and r["resident"]["optimizer_state"] == 0
        assert r["file_bytes"] == r["state_bytes"]
        assert r["grad_norm"] > 0


def test_unusable_nvme_path_is_a_clear_error_before_training(tmp_path):
    import zerotrain

    model = make_model()
    cfg = zero_config(2, 1, 1, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="missing"):
        zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
