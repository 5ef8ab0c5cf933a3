"""zero.Init: a model built already deferred, materialized unit by unit into its shards.

Peak memory is read from /proc/self/status (VmHWM after resetting it through
/proc/self/clear_refs, minus the VmRSS before construction): it sees torch's
allocations, which tracemalloc does not. The ranks set glibc's mmap threshold to
1 MiB so a freed tensor goes back to the kernel: RSS then follows the tensors
held, not what the allocator keeps around after a free.
"""

from __future__ import annotations

import pytest

import re

import torch
from torch import nn

from conftest import run_on_ranks
from llama_workload import STEPS, global_batch, make_model, param_groups, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

MiB = 2**20


def _gathered(engine) -> dict[str, torch.Tensor]:
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _train_under_init() -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.zero import Init

    rank = init_distributed().rank
    # A different seed on each rank: the ranks agree only through rank 0's.
    with Init(config=zero_config(3, 2, 1)):
        model = make_model(freeze_one=True, seed=rank)
    deferred = all(p.is_meta for p in model.parameters())
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(3, 2, 1))
    initial = _gathered(engine)
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)
        chunk = ids[rank * 4 : (rank + 1) * 4]
        loss = engine(input_ids=chunk, labels=chunk).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    final = _gathered(engine)
    # The same model at stage 2: each rank keeps the whole parameters it computed itself.
    with Init():
        model2 = make_model(freeze_one=True, seed=rank)
    zerotrain.initialize(model=model2, model_parameters=param_groups(model2), config=zero_config(2, 2, 1))
    whole = {n: p.detach().clone() for n, p in model2.named_parameters()}
    dist.barrier()
    return {"deferred": deferred, "initial": initial, "losses": losses, "final": final, "whole": whole}


def test_model_built_under_init_trains_at_stage3_and_ranks_agree():
    r0, r1 = run_on_ranks(2, _train_under_init)
    assert r0["deferred"] and r1["deferred"]
    # Every rank computed the same values without any broadcast of weights...
    for name in r0["whole"]:
        assert torch.equal(r0["whole"][name], r1["whole"][name]), name
    # ...and the stage-3 shards compose exactly that model (frozen q_proj included).
    for r in (r0, r1):
        for name in r0["whole"]:
            assert torch.equal(r["initial"][name], r0["whole"][name]), name
    for name in r0["final"]:
        assert torch.equal(r0["final"][name], r1["final"][name]), name
    assert torch.equal(r0["final"]["model.layers.0.self_attn.q_proj.weight"],
                       r0["initial"]["model.layers.0.self_attn.q_proj.weight"])  # frozen stays
    for r in (r0, r1):
        first, last = r["losses"][0], sum(r["losses"][-3:]) / 3
        assert last < first - 0.5, r["losses"]


def _llama_config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager", **extra,
    )


def _materialize(model: nn.Module) -> None:
    """What initialize does to the parameters, in this process (stage 0, world 1)."""
    from zerotrain.zero.stage import StagePlan, build_flat_params

    trainable = [p for p in model.parameters() if p.requires_grad]
    build_flat_params(model, [trainable], StagePlan(0), 10**9, torch.float32)


def test_values_follow_the_models_init_scheme():
    from transformers import LlamaForCausalLM

    from zerotrain.zero import Init

    cfg = _llama_config(initializer_range=0.01)  # not torch's default: proves HF's _init_weights ran
    with Init():
        model = LlamaForCausalLM(cfg)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)  # frozen: materialized whole, too
    assert all(p.is_meta for p in model.parameters())
    _materialize(model)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
        if p.ndim == 2:  # Linear and Embedding weights: normal(0, initializer_range)
            assert abs(p.std().item() - 0.01) < 0.001 and abs(p.mean().item()) < 0.001, (name, p.std())
        else:  # RMSNorm weights
            assert torch.equal(p, torch.ones_like(p)), name
    # Buffers (rotary inv_freq, computed in __init__) are valid: the same weights in a model
    # built normally give the same logits.
    reference = LlamaForCausalLM(cfg)
    reference.load_state_dict(model.state_dict())
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-6)
    assert not any("_zerotrain" in k or k == "_apply" for m in model.modules() for k in vars(m))


class _Scale(nn.Module):
    """A custom module: a parameter set in __init__ (no reset_parameters) and a derived buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((dim,), 0.5))
        self.register_buffer("freq", 1.0 / (10.0 ** (torch.arange(dim) / dim)), persistent=False)

    def forward(self, x):
        return x * self.gain * self.freq


def test_torch_modules_use_reset_parameters_and_keep_init_values():
    from zerotrain.zero import Init

    torch.manual_seed(0)
    with Init():
        model = nn.Sequential(nn.Linear(16, 32), _Scale(32), nn.LayerNorm(32), nn.Linear(32, 4))
    assert all(p.is_meta for p in model.parameters())
    _materialize(model)
    w = model[0].weight
    bound = 1 / 16**0.5  # nn.Linear.reset_parameters: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), +)
    assert w.abs().max() <= bound and w.std() > bound / 3
    assert torch.equal(model[1].gain, torch.full((32,), 0.5))
    assert torch.allclose(model[1].freq, 1.0 / (10.0 ** (torch.arange(32) / 32)))
    assert torch.equal(model[2].weight, torch.ones(32)) and torch.equal(model[2].bias, torch.zeros(32))
    assert model(torch.randn(3, 16)).isfinite().all()


def test_disabled_init_builds_a_normal_model():
    from zerotrain.zero import Init

    with Init(enabled=False):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    assert not any(p.is_meta for p in model.parameters())
    assert not any("_zerotrain" in k or k == "_apply" for m in model.modules() for k in vars(m))
    with Init():
        pass
    after = nn.Linear(4, 4)  # the registration hooks are gone once the context exits
    assert not after.weight.is_meta and "_apply" not in vars(after)


# --- peak memory --------------------------------------------------------------------------


def _big_llama():
    from transformers import LlamaConfig, LlamaForCausalLM  # imported before the baseline is taken

    # ~43M parameters (172 MB fp32): 12 layers of 13 MB, the root (tied embedding) 16 MB.
    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _proc_status("VmRSS")


def _peak_memory(use_init: bool) -> dict:
    import ctypes
    import gc

    from zerotrain import initialize  # loaded on first use: import it here, outside the measured window
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.zero import Init
    from zerotrain.zero.flat_param import FlatParam
    from zerotrain.zero.units import find_layer_units

    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401 - imports are not the model's memory

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: see the module docstring
    init_distributed()
    config = zero_config(3, 2, 1)
    gc.collect()
    base = _reset_peak()
    with Init(enabled=use_init):
        model = _big_llama()
    built = _proc_status("VmHWM") - base
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    unit_bytes = max(
        sum(p.numel() * 4 for p in unit.parameters())
        for unit in [*find_layer_units(model), model.model.embed_tokens]  # the root: embedding (tied), norm
    )
    # The stage-3 gradient shards are allocated after every unit is sharded: record the peak up to then.
    marks: list[int] = []
    grad_of_shard = FlatParam.grad_of_shard

    def record_first(self):
        if not marks:
            marks.append(_proc_status("VmHWM") - base)
        return grad_of_shard(self)

    FlatParam.grad_of_shard = record_first
    try:
        engine, *_ = initialize(model=model, config=config)
    finally:
        FlatParam.grad_of_shard = grad_of_shard
    peak = _proc_status("VmHWM") - base
    held = sum(engine.memory_breakdown().values())
    return {"built": built, "sharded": marks[0], "peak": peak, "held": held, "model": model_bytes, "unit": unit_bytes}


SLACK = 24 * MiB  # construction's own objects (~8 MB), Gloo, temporaries


def test_peak_memory_is_shards_plus_one_unit():
    for r in run_on_ranks(2, _peak_memory, True, spawn=True):
        model, unit = r["model"], r["unit"]
        report = {k: f"{v / MiB:.1f} MiB" for k, v in r.items()}
        assert model > 150 * MiB and unit < model / 8, report
        # Construction keeps no parameter; it replays each initializer on scratch stand-ins for one
        # module's parameters at a time (the generator then moves on as in an eager build).
        assert r["built"] < unit + 16 * MiB, report
        # Until the gradient shards exist: this rank's parameter shards and one whole unit (with
        # that unit's new shard, copied out before the unit's buffer is freed).
        assert r["sharded"] <= model / 2 + unit * 1.5 + SLACK, report
        assert r["sharded"] < 0.75 * model, report
        # The whole of initialize: what the rank keeps (parameter and gradient shards) plus one unit.
        assert r["peak"] <= r["held"] + unit + SLACK, report


def test_peak_memory_without_init_holds_the_whole_model():
    """The contrast, proving the measurement sees parameter memory."""
    for r in run_on_ranks(2, _peak_memory, False, spawn=True):
        report = {k: f"{v / MiB:.1f} MiB" for k, v in r.items()}
        assert r["built"] >= r["model"], report
        assert r["sharded"] >= r["model"], report


def _adapter_added_after_init(stage: int) -> dict:
    import zerotrain
    from zerotrain.comm.distributed import init_distributed

    rank = init_distributed().rank
    with zerotrain.zero.Init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    # A layer attached after the build (as PEFT adds adapters), and a frozen one: real tensors,
    # different on each rank; rank 0's must survive initialize.
    torch.manual_seed(100 + rank)
    model.append(nn.Linear(4, 4))
    model.append(nn.Linear(4, 2).requires_grad_(False))
    added = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("2.", "3."))}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return {"added": added, "after": {n: t for n, t in _gathered(engine).items() if n in added}}


def test_parameters_added_after_a_zero_init_build_keep_rank0s_values():
    for stage in (2, 3):
        ranks = run_on_ranks(2, _adapter_added_after_init, stage)
        assert not torch.equal(ranks[0]["added"]["2.weight"], ranks[1]["added"]["2.weight"])
        for result in ranks:
            assert result["after"].keys() == ranks[0]["added"].keys()
            for name, value in ranks[0]["added"].items():
                assert torch.equal(result["after"][name], value), (stage, name)
