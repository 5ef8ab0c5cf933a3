"""The `flops_profiler` section: exact FLOPs for an eager Llama, SDPA's analytic term, recompute
apart, whole parameters at stage 3, and a report at `profile_step` that changes no loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, zero_config
from zerotrain.profiling.step_flops import StepFlops

HIDDEN, LAYERS, SEQ, BATCH = 64, 2, 32, 2


def _llama(attention: str, checkpointing: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _count(model) -> StepFlops:
    ids = torch.randint(0, 256, (BATCH, SEQ))
    flops = StepFlops(model)
    flops.start()
    loss = model(input_ids=ids, labels=ids).loss
    flops.backward()
    loss.backward()
    flops.stop()
    return flops


def _expected(model) -> int:
    # N: weights that enter matmuls (every Linear, the LM head included; not the embedding lookup
    # or the norms, which are no matmul). 6NT for the matmuls, 12.L.s.h.T for QK^T and AV.
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    tokens = BATCH * SEQ
    return 6 * n * tokens + 12 * LAYERS * SEQ * HIDDEN * tokens


def test_an_eager_llamas_step_counts_exactly_6NT_plus_12LshT():
    model = _llama("eager")
    flops = _count(model)
    assert flops.model_flops == _expected(model) and flops.hardware_flops == flops.model_flops
    assert not flops.analytic_modules


def test_sdpa_on_a_cpu_gets_the_analytic_attention_term_and_says_where():
    model = _llama("sdpa")
    flops = _count(model)
    assert flops.model_flops == _expected(model)
    assert {f"LlamaForCausalLM.model.layers.{i}.self_attn" for i in range(LAYERS)} <= flops.analytic_modules


def test_checkpointing_keeps_model_flops_and_counts_the_recompute_as_hardware_flops():
    plain = _count(_llama("eager"))
    model = _llama("eager", checkpointing=True)
    ckpt = _count(model)
    assert ckpt.model_flops == plain.model_flops
    recompute = ckpt.hardware_flops - ckpt.model_flops
    layers_forward = sum(plain.module_flops(f"LlamaForCausalLM.model.layers.{i}", "forward") for i in range(LAYERS))
    # torch's checkpoint stops a recompute once backward has what it needs: at most one forward of the layers
    assert 0.75 * layers_forward <= recompute <= layers_forward


def _train(world: int, stage: int, profile: bool, out: str | None) -> tuple[list[float], str | None, int]:
    import torch.distributed as dist

    import zerotrain

    cfg = zero_config(stage, world, 1)
    if profile:
        cfg["flops_profiler"] = {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 2,
                                 "detailed": True, "output_file": out}
    model = make_model()
    engine, *_ = zerotrain.initialize(model=model, config=cfg)
    rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(3):
        ids = global_batch(step)[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.flops_profiler.report if profile else None
    engine.destroy()
    return losses, report, sum(p.numel() for p in make_model().parameters())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])
def test_the_engine_writes_the_report_at_profile_step_and_trains_the_same(stage, tmp_path):
    out = tmp_path / "flops.txt"
    profiled = run_on_ranks(2, _train, 2, stage, True, str(out))
    plain = run_on_ranks(2, _train, 2, stage, False, None)
    # Before profile_step the runs are bitwise equal. Counting the profiled step under torch's
    # FlopCounterMode (a dispatch mode) can change which kernel a composite op takes, so on some
    # CPUs that step's gradients differ in the last bit: from then on, equal to fp32 rounding.
    for with_profile, without in zip(profiled, plain):
        assert with_profile[0][0] == without[0][0]
        torch.testing.assert_close(torch.tensor(with_profile[0]), torch.tensor(without[0]), rtol=1e-6, atol=0.0)
    text = out.read_text()
    assert text == profiled[0][1] and profiled[1][1] is None  # rank 0 reports
    assert "Profile Summary at step 1:" in text and "world size: " in text
    assert "Aggregated Profile per GPU" in text and "Detailed Profile per GPU" in text
    assert "(layers): ModuleList(" in text and "MFU (model FLOPS / device peak): " in text
    total_params = profiled[0][2]  # counted whole at stage 3, though each rank keeps half
    line = next(x for x in text.splitlines() if x.startswith("params per GPU: "))
    assert line.split()[-2:] == _params_text(total_params).split()


def _params_text(n: int) -> str:
    from zerotrain.profiling.flops_report import _num

    return _num(n)
