"""What the speed check measures against: FLOPs per step, the GPU's peak, the planner's memory.

* FLOPs: zerotrain's own counter (`zerotrain.profiling.step_flops.StepFlops`, torch's
  FlopCounterMode filed by phase) run over one training micro-step of the very model, built
  from fake tensors (shapes only: no memory, no device, a few seconds for 1B on the CPU). Model
  FLOPs = forward + backward (what MFU counts, checkpointing or not); hardware FLOPs add the
  forward that checkpointing recomputes. The analytic count is kept beside it as a check:
  6 x (weights of the linear layers) per token, plus attention's QK^T and AV, 12 x layers x
  seq x (heads x head_dim) per token (the full square, as FlopCounterMode and PaLM's MFU count
  it, causal or not). Counted and analytic agree exactly for a Llama; the analytic number
  stands in if the counter fails.
* Peak: the dense bf16 datasheet rate, looked up by the device's name.
* Memory: the planner's prediction for the rung (zerotrain/planning/rung_memory.py
  `estimate_rung`: stage, checkpointing, micro-batch, bf16, SDPA, one GPU) -> `gpu_total`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30

def peak_tflops(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOP/s, where it comes from) for a device name; (None, why) if unknown.
    The table is zerotrain's own (zerotrain/profiling/device_peaks.py), the one `zerotrain train` uses."""
    from zerotrain.profiling.device_peaks import peak_tflops_by_name

    tflops = peak_tflops_by_name(device_name)
    if tflops is None:
        return None, f"no dense bf16 peak known for {device_name!r}: MFU not computed (pass --peak-tflops)"
    return tflops, f"datasheet dense bf16 peak for {device_name!r} (zerotrain/profiling/device_peaks.py)"


@dataclass(frozen=True)
class StepFlopCount:
    """FLOPs of one optimizer step (one micro-batch) of the job."""

    model: int
    """Forward + backward."""
    recompute: int
    """The forward checkpointing runs again in backward (hardware FLOPs = model + this)."""
    analytic_model: int
    method: str

    def hardware(self, checkpointing: bool) -> int:
        return self.model + (self.recompute if checkpointing else 0)


def analytic_flops(cfg, micro_batch: int, seq: int) -> tuple[int, int]:
    """(model FLOPs, recomputed-forward FLOPs) of one micro-step, from the config alone."""
    h, layers, heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads
    tokens = micro_batch * seq
    layer_linear = h * heads * d * 2 + 2 * h * kv * d + 3 * h * cfg.intermediate_size
    attention_fwd = 4 * seq * heads * d  # per token per layer: QK^T and AV, 2 FLOPs per multiply-add
    head = h * cfg.vocab_size
    model = 3 * tokens * (2 * (layers * layer_linear + head) + layers * attention_fwd)
    # Each layer's forward again, up to its last saved tensor: non-reentrant checkpointing stops the
    # recompute early (torch's default), so down_proj, whose output nothing saves, does not run.
    recompute = tokens * layers * (2 * (layer_linear - h * cfg.intermediate_size) + attention_fwd)
    return model, recompute


def count_flops(cfg, micro_batch: int, seq: int) -> StepFlopCount:
    """FLOPs of one micro-step, counted by zerotrain's StepFlops over a fake-tensor model."""
    analytic, analytic_recompute = analytic_flops(cfg, micro_batch, seq)
    try:
        model, recompute = _counted(cfg, micro_batch, seq)
        method = ("zerotrain.profiling.step_flops.StepFlops (torch FlopCounterMode) over one fake-tensor micro-step; "
                  "model FLOPs = forward + backward, attention as its full s^2 square")
    except Exception as exc:  # noqa: BLE001 - a transformers/torch pair the fake-tensor run does not go through
        model, recompute = analytic, analytic_recompute
        method = (f"analytic (6 x linear weights + 12 x layers x seq x heads x head_dim, per token): the counter "
                  f"failed ({type(exc).__name__}: {str(exc)[:120]})")
    return StepFlopCount(model, recompute, analytic, method)


def _counted(cfg, micro_batch: int, seq: int) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaForCausalLM
    from workload import enable_checkpointing

    from zerotrain.profiling.step_flops import StepFlops

    # Fake tensors (not meta): transformers skips its data-dependent mask checks for them.
    with FakeTensorMode():
        model = LlamaForCausalLM(cfg)
        model.config.use_cache = False
        enable_checkpointing(model)  # the recompute is counted apart; forward + backward do not change
        model.train()
        tokens = torch.zeros(micro_batch, seq, dtype=torch.long)
        flops = StepFlops(model)
        flops.start()
        try:
            loss = model(input_ids=tokens, labels=tokens).loss
            flops.backward()
            loss.backward()
        finally:
            flops.stop()
    return flops.model_flops, flops.total("recompute")


# The planner models zerotrain; the other engines' columns are set against the same rung.
PLANNER_STAGE = {"plain": 0, "fsdp2": 3}


def planner_stage(engine: str) -> int | None:
    """The ZeRO stage whose prediction an engine's column is compared with."""
    family, _, rest = engine.partition("-")
    if family in PLANNER_STAGE:
        return PLANNER_STAGE[family]
    return int(rest.split("-")[0]) if rest[:1].isdigit() else None


def prediction_key(column: str, mode: str, micro_batch: int) -> str:
    """The planner prediction a column's row is set against: "<stage>/<mode>/mb<micro-batch>"."""
    from speed_variants import column_micro_batch

    return f"{planner_stage(column)}/{mode}/mb{column_micro_batch(column, micro_batch)}"


# Seconds a column costs per checkpointing mode on one H100 (process start overlaps the previous column):
# eager, from the loans' runs (8 columns in 190 s); compiled adds inductor's compile of one layer's forward
# and backward, a guess until a loan measures it (the first column fills inductor's on-disk cache, later
# ones mostly hit it). The dry run's figures are this machine's (2 CPU cores, aot_eager).
COLUMN_SECONDS = {"gpu": {"eager": 25, "compile_first": 100, "compile": 45},
                  "dry": {"eager": 3, "compile_first": 8, "compile": 6}}


def budget_line(columns: list[str], modes: list[str], budget_s: float, dry: bool) -> str:
    """The run's estimated length against its budget, naming the columns it would cut (the list's tail)."""
    cost = COLUMN_SECONDS["dry" if dry else "gpu"]
    total, cut, compiled = 0.0, [], 0
    for column in columns:
        each = cost["eager"]
        if "-compile" in column:
            each += cost["compile_first"] if compiled == 0 else cost["compile"]
            compiled += 1
        total += each * len(modes)
        if total > budget_s:
            cut.append(column)
    return (f"estimated {total:.0f} s for {len(columns)} columns x {len(modes)} modes against the {budget_s:.0f} s "
            "budget" + (f"; likely not reached: {', '.join(cut)}" if cut else ""))


def predict_gpu_bytes(args, cfg, stage: int, checkpointing: bool, micro_batch: int,
                      gpu_memory: int | None, world: int = 1) -> int:
    """The planner's GPU bytes for one rank of this job at `stage` (`world` GPUs of one node, no offload)."""
    from transformers import LlamaForCausalLM
    from workload import ds_config

    from zerotrain.planning.ladder import Rung
    from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    base = ds_config(_with(args, micro_batch=micro_batch), stage)
    estimate = estimate_rung(model, Rung(stage, gradient_checkpointing=checkpointing),
                             Workload(args.seq, micro_batch, args.dtype, "sdpa"),
                             Hardware(gpus_per_node=world, gpu_memory=gpu_memory), base)
    return estimate.gpu_total


def choose_micro_batch(args, cfg, gpu_memory: int, fraction: float, candidates=(8, 4, 2, 1)) -> tuple[int, str]:
    """The largest candidate whose stage-0, no-checkpointing prediction fits `fraction` of the GPU.

    The margin covers what the planner does not model: DeepSpeed's fp32 gradient buffers, plain
    torch's fp32 weights with autocast copies, and the caching allocator's fragmentation.
    """
    for mb in candidates:
        try:
            need = predict_gpu_bytes(args, cfg, 0, False, mb, gpu_memory)
        except Exception as exc:  # noqa: BLE001 - the run goes on at a micro-batch that fits 80 GB
            return 4, f"the planner failed ({type(exc).__name__}: {str(exc)[:120]}); 4, which fits an 80 GB GPU"
        if need <= fraction * gpu_memory:
            return mb, (f"largest of {list(candidates)} whose planner prediction (stage 0, no checkpointing, "
                        f"{need / GIB:.1f} GiB) fits {fraction:.0%} of the GPU's {gpu_memory / GIB:.1f} GiB")
    return candidates[-1], "nothing fits the margin; the smallest candidate"


def _with(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})
