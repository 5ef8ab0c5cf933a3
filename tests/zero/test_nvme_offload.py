"""ZeRO-Infinity: with offload to NVMe the files hold the state, and memory does not grow with the model.

One launch of two ranks runs every distributed case (spawning is the slow part):
optimizer state on NVMe; parameters and optimizer state on NVMe at two depths of the
same model, with a probe of what the process holds at every hook of forward,
backward and step; a checkpoint round trip and GatheredParameters' modifier with
parameters on NVMe. In-process tests check the errors raised before training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_on_ranks
from llama_workload import SEQ, VOCAB, global_batch, make_model, param_groups, zero_config
from zerotrain.config import ConfigError

WORLD = 2
DEPTHS = (8, 16)  # layers: the deeper model has about twice the state
BUFFERS = 2  # buffer_count of both stores: I/O operations in flight per store
SUB_GROUP = 2000


def _nvme(path: str, **extra) -> dict:
    return {"device": "nvme", "nvme_path": path, "buffer_count": BUFFERS, **extra}


def _train(engine, steps: range) -> list[float]:
    import torch.distributed as dist

    micro, rank, losses = engine.train_micro_batch_size_per_gpu(), dist.get_rank(), []
    for step in steps:
        ids = global_batch(step)[rank * micro :][:micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _held(engine) -> int:
    b = engine.memory_breakdown()
    return b["params"] + b["grads"] + b["master"] + b["optimizer_state"]


def _store_files(store) -> int:
    store.wait_all()  # pending writes end (and release their tensors)
    return sum(p.stat().st_size for p in Path(store.directory).iterdir())


def _optimizer_on_nvme(path: str) -> dict:
    import zerotrain

    model = make_model()
    cfg = zero_config(3, WORLD, 1, offload_optimizer=_nvme(path), sub_group_size=3000)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    _train(engine, range(3))
    files = _store_files(engine.optimizer.nvme.store)
    return {
        "resident": engine.memory_breakdown(),
        "file_bytes": files,
        "shard_elements": sum(fp.shard_size for fp in engine.flat_params),
        "grad_norm": engine.get_global_grad_norm(),
    }


def _everything_on_nvme(path: str, layers: int) -> dict:
    """Params + optimizer on NVMe, nothing cached; the peak of what the process holds, probed
    before and after every module's forward, after every gradient, and around each sub-group's step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerotrain

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="eager",
    ))
    cfg = zero_config(
        3, WORLD, 1, offload_param=_nvme(path, max_in_cpu=0), offload_optimizer=_nvme(path), sub_group_size=SUB_GROUP,
        # one layer unit prefetched, none kept from forward for backward: the working set is a few units
        stage3_prefetch_bucket_size=10_000, stage3_max_reuse_distance=0,
    )
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    peak = [0]

    def probe(*_):
        peak[0] = max(peak[0], _held(engine))

    for m in engine.module.modules():
        m.register_forward_pre_hook(probe)
        m.register_forward_hook(probe)
    for p in engine.module.parameters():
        p.register_post_accumulate_grad_hook(probe)  # runs after the GradReducer's
    engine.optimizer.optimizer.register_step_pre_hook(probe)
    engine.optimizer.optimizer.register_step_post_hook(probe)
    _train(engine, range(3))
    fps = engine.flat_params
    layer_units = {}
    for fp in fps:
        if fp.unit is not engine.module:
            layer_units[id(fp.unit)] = layer_units.get(id(fp.unit), 0) + fp.padded_numel
    param_files = _store_files(next(fp.swap for fp in fps if fp.swap is not None).store)
    state_files = _store_files(engine.optimizer.nvme.store)
    return {
        "peak": peak[0],
        "between_steps": engine.memory_breakdown(),
        "shard_elements": sum(fp.shard_size for fp in fps),
        "root_unit": sum(fp.padded_numel for fp in fps if fp.unit is engine.module),
        "layer_unit": max(layer_units.values()),
        "largest_shard": max(fp.shard_size for fp in fps),
        "param_file_bytes": param_files,
        "state_file_bytes": state_files,
    }


def _checkpoint_round_trip(path: str, ckpt: str) -> dict:
    """Saves after 2 steps and goes on 2 more; a second engine loads the checkpoint and does the same."""
    import zerotrain
    from zerotrain.zero import GatheredParameters

    cfg = zero_config(3, WORLD, 1, offload_param=_nvme(path, max_in_cpu=3000), offload_optimizer=_nvme(path))
    out = {}
    for name, seed in (("saved", 0), ("loaded", 123)):
        model = make_model(seed=seed)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        if name == "saved":
            _train(engine, range(2))
            engine.save_checkpoint(ckpt)
        else:
            engine.load_checkpoint(ckpt)
        losses = _train(engine, range(2, 4))
        with GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out[name] = {"losses": losses, "weights": weights}
    return out


def _modify_parked_weights(path: str) -> dict:
    """GatheredParameters' modifier writes a shard and master that live on NVMe."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero import GatheredParameters

    model = make_model()
    cfg = zero_config(3, WORLD, 1, offload_param=_nvme(path, max_in_cpu=0), offload_optimizer=_nvme(path))
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    _train(engine, range(1))
    head = engine.module.lm_head.weight
    with GatheredParameters(head, modifier_rank=0):
        if dist.get_rank() == 0:
            head.data.fill_(0.5)
    fp = head._zerotrain_flat_param
    with GatheredParameters(head):
        gathered = head.detach().clone()
    with engine.optimizer.states_resident():
        i = next(i for i, p in enumerate(fp.params) if p is head)
        off, n = fp.offsets[i], fp.numels[i]
        lo, hi = max(off, fp.shard_start), min(off + n, fp.shard_start + fp.shard_size)
        master = fp.master[lo - fp.shard_start : max(hi, lo) - fp.shard_start].clone()
    return {"gathered": gathered, "master": master}


def _all_cases(path: str, ckpt: str) -> dict:
    return {
        "optimizer": _optimizer_on_nvme(path),
        **{layers: _everything_on_nvme(path, layers) for layers in DEPTHS},
        "checkpoint": _checkpoint_round_trip(path, ckpt),
        "modifier": _modify_parked_weights(path),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme")
    return run_on_ranks(WORLD, _all_cases, str(root), str(root / "ckpt"))


@pytest.mark.slow
def test_master_optimizer_state_and_gradients_live_in_files_between_steps(runs):
    for r in (rank["optimizer"] for rank in runs):
        assert r["resident"]["master"] == 0 and r["resident"]["optimizer_state"] == 0 and r["resident"]["grads"] == 0
        # fp32 master + exp_avg + exp_avg_sq, and the fp32 gradient shard (stage 3 parks it too)
        assert r["file_bytes"] == (12 + 4) * r["shard_elements"]
        assert r["grad_norm"] > 0


def _bound(r: dict) -> int:
    """What the process may hold at once, in bytes (fp32: 4 per element), from unit sizes alone:
    - parameters and gradients of the root unit (whole through forward and backward) and three
      layer units (one computing, one prefetched, gradients awaiting their reduce-scatter), whole;
    - the I/O in flight on both stores, `BUFFERS` each, of at most the largest shard;
    - at the step, two sub-groups (the one stepping, the next being read) of master, Adam's two
      moments and gradient: 16 bytes an element; a sub-group is at least one bucket."""
    whole = r["root_unit"] + 3 * r["layer_unit"]
    in_flight = 2 * BUFFERS * r["largest_shard"]
    stepping = 2 * max(SUB_GROUP, r["largest_shard"])
    return 4 * (2 * whole + in_flight) + 16 * stepping


@pytest.mark.slow
def test_params_and_optimizer_on_nvme_hold_a_bound_that_does_not_grow_with_the_model(runs):
    """The peak held during forward, backward and step stays under a bound that is the same for
    a model twice as deep; ZeRO-3 without offload holds 16 bytes a shard element, more than
    the bound already for the shallower model, and twice that for the deeper one."""
    for rank in runs:
        small, large = (rank[layers] for layers in DEPTHS)
        assert large["shard_elements"] > 1.8 * small["shard_elements"]
        assert _bound(small) == _bound(large)
        for r in (small, large):
            assert r["peak"] <= _bound(r), f"held {r['peak']} bytes at peak, bound {_bound(r)}"
            assert 16 * r["shard_elements"] > _bound(r)
            assert all(v == 0 for k, v in r["between_steps"].items() if k != "optimizer_scalars"), r["between_steps"]
            assert r["param_file_bytes"] == 4 * r["shard_elements"]  # fp32 parameter shards
            assert r["state_file_bytes"] == 16 * r["shard_elements"]  # master, Adam moments, gradients


@pytest.mark.slow
def test_checkpoint_round_trip_with_params_on_nvme(runs):
    for rank in runs:
        saved, loaded = rank["checkpoint"]["saved"], rank["checkpoint"]["loaded"]
        assert loaded["losses"] == saved["losses"]
        for name, t in saved["weights"].items():
            assert torch.equal(loaded["weights"][name], t), f"{name} differs after loading"


@pytest.mark.slow
def test_gathered_parameters_modifier_reaches_parked_shard_and_master(runs):
    for rank in runs:
        r = rank["modifier"]
        assert torch.all(r["gathered"] == 0.5)
        assert torch.all(r["master"] == 0.5)  # this rank's slice of lm_head (possibly empty)
    assert any(rank["modifier"]["master"].numel() for rank in runs)


def _initialize(zero_extra: dict):
    import zerotrain

    model = make_model()
    zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(3, 1, 1, **zero_extra))


@pytest.mark.slow
def test_unusable_nvme_path_is_a_clear_error_before_training(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="missing"):
        _initialize({"offload_optimizer": {"device": "nvme", "nvme_path": missing}})
    with pytest.raises(ConfigError, match="missing"):
        _initialize({"offload_param": {"device": "nvme", "nvme_path": missing}})


def test_too_little_disk_for_params_and_optimizer_state_is_a_clear_error(tmp_path, monkeypatch):
    import shutil

    elements = sum(p.numel() for p in make_model().parameters())  # one rank: its shards are everything
    usage = shutil.disk_usage(tmp_path)
    # Room for either store alone (master, Adam moments and gradients: 16 bytes an element;
    # parameters: 4), not for both on the same disk.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=16 * elements + 1))
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"GB free but .* GB are needed"):
        _initialize({"offload_param": nvme, "offload_optimizer": nvme})


def test_store_allocate_and_discard_move_no_bytes(tmp_path):
    """The two calls that make clean shards and fresh gradients cheap: no read, no write."""
    from zerotrain.zero.nvme_store import NvmeStore

    with NvmeStore(tmp_path, rank=0) as store:
        t = torch.arange(10.0)
        store.swap_out("shard", t)
        store.wait("shard")
        assert t.untyped_storage().nbytes() == 0
        store.allocate("shard", t)  # memory back, file not read: about to be overwritten
        t.fill_(7.0)
        store.discard("shard", t)  # dropped, file not written
        assert t.untyped_storage().nbytes() == 0
        store.swap_in("shard", t)
        assert torch.equal(t, torch.arange(10.0))  # what the file held
        fresh = torch.empty(4)
        fresh.untyped_storage().resize_(0)
        store.allocate("new", fresh)  # a key with no file yet
        fresh.fill_(1.0)
        store.swap_out("new", fresh)
        store.swap_in("new", fresh)
        assert torch.equal(fresh, torch.ones(4))
