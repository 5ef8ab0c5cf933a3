"""`zerotrain plan --verify`: three real steps of the plan, measured against its prediction.

The chosen config runs on this machine, one process per GPU (or per CPU rank on a machine
without GPUs, over Gloo), started by torch's elastic launcher in-process. Each rank builds the
model from its config with random weights (under `zero.Init` at stage 3), trains 3 steps on
random tokens and reports what it held:
- model states: `engine.memory_breakdown()` after the last step (the estimator's exact terms);
- activations: the bytes autograd saved during the last forward (`saved_tensors_hooks`);
- on a GPU, the allocator's peak (`torch.cuda.max_memory_allocated`), the figure that has to fit.
A rung that runs out of memory, or whose measured peak exceeds `--gpu-memory`, is left out and
the plan falls to the next rung, saying so.
"""

from __future__ import annotations

import argparse

import torch

from zerotrain.comm.fault_points import fault_point
from zerotrain.planning.local_job import recorded
from zerotrain.planning.planner import Plan, make_plan
from zerotrain.config.byte_sizes import format_bytes

STEPS = 3


def verify_plan(plan: Plan, model, args: argparse.Namespace, base: dict | None) -> Plan:
    """Runs the plan's choice; on a misfit re-plans without it, until one fits or none is left."""
    hardware = plan.hardware
    assert hardware is not None and plan.workload is not None
    local = torch.cuda.device_count() if torch.cuda.is_available() else hardware.world_size
    if hardware.nodes > 1 or hardware.world_size > local:
        raise ValueError(f"--verify runs on this machine: --gpus {hardware.world_size} needs more devices than "
                         f"its {local}; verify a plan for the GPUs of one node")
    excluded: set = set()
    notes: list[str] = []
    records: list[dict] = []
    while plan.choice is not None:
        measured = _run(plan, model, base, getattr(args, "master_port", None))
        predicted = plan.choice.gpu_total
        peak = measured.get("peak_allocated")
        fits = not measured["oom"] and (peak is None or peak + plan.choice.gpu_reserve <= hardware.gpu_memory)
        if peak is None and not measured["oom"]:
            # No allocator to ask on a CPU: the measured terms stand in for the device's peak.
            total = measured["model_states"] + measured["activations"] + plan.choice.gpu["logits peak"]
            fits = total + plan.choice.gpu_reserve <= hardware.gpu_memory
        notes.append(_describe(plan, measured, predicted, fits))
        records.append({"rung": plan.choice.rung.name, "micro_batch": plan.choice.micro_batch, "fits": fits,
                        "measured": measured, "predicted": _predicted(plan)})
        if fits:
            break
        excluded.add(plan.choice.rung)
        plan = make_plan(model, hardware, plan.workload.seq_len, plan.global_batch, plan.workload.dtype,
                         plan.workload.attention, base, args.gradient_checkpointing, frozenset(excluded),
                         rates=plan.rates, loss_chunk_tokens=plan.workload.loss_chunk_tokens)
    plan.verification = records
    if not args.json:
        for line in notes:
            print(line)
    return plan


def _predicted(plan: Plan) -> dict:
    """The prediction in the measured terms: model states per rank, activations with the logits peak."""
    c = plan.choice
    states = c.gpu["parameters"] + c.gpu["gradients"] + c.gpu["master + optimizer"]
    states += sum(v for k, v in {**c.cpu_per_node, **c.nvme_per_node}.items() if k != "nvme swap buffers") \
        // plan.hardware.gpus_per_node
    return {"model_states": states, "activations": c.gpu["activations"] + c.gpu["logits peak"],
            "gpu_total": c.gpu_total}


def _describe(plan: Plan, m: dict, predicted: int, fits: bool) -> str:
    rung = plan.choice.rung.name
    if m["oom"]:
        return f"verify {rung}: out of memory on rank {m['oom_rank']}; falling to the next rung"
    p = _predicted(plan)
    parts = [f"model states {m['model_states']:,} B measured vs {p['model_states']:,} B predicted",
             f"activations {format_bytes(m['activations'])} vs {format_bytes(p['activations'])}"]
    if m.get("peak_allocated") is not None:
        parts.append(f"peak {format_bytes(m['peak_allocated'])} vs {format_bytes(predicted)}")
    verdict = "fits" if fits else "does not fit; falling to the next rung"
    return f"verify {rung} ({STEPS} steps): " + ", ".join(parts) + f" — {verdict}"


def _run(plan: Plan, model, base: dict | None, master_port: int | None = None) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from zerotrain.planning.local_job import run_local_job

    ds = plan.deepspeed_config(base)
    work = plan.workload_at_choice()
    try:
        # A rank that runs out of memory raises: the agent then stops every rank, so none is
        # left waiting in a collective for it.
        results = run_local_job(_worker, plan.hardware.world_size, model.config.to_dict(), ds, work.seq_len,
                                work.micro_batch, plan.accumulation, work.attention,
                                plan.choice.rung.gradient_checkpointing, work.loss_chunk_tokens, name="zerotrain-verify",
                                master_port=master_port)
    except ChildFailedError as error:
        oom = sorted(rank for rank, f in error.failures.items() if _is_oom(f.message))
        if oom:
            return {"oom": True, "oom_rank": oom[0]}
        raise RuntimeError(f"--verify: the verification run failed:\n{error}") from None
    first = results[0]
    return {"oom": False, **{k: max(r[k] or 0 for r in results.values()) if first[k] is not None else None
                             for k in ("model_states", "activations", "peak_allocated")}}


def _is_oom(message) -> bool:
    text = str(message)
    return "OutOfMemoryError" in text or "out of memory" in text


@recorded
def _worker(config_dict: dict, ds: dict, seq_len: int, micro: int, accumulation: int, attention: str,
            checkpointing: bool | str, loss_chunk_tokens: int | None = None) -> dict:
    """One rank: build, train `STEPS` steps on random tokens, report bytes (or the OOM)."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import zerotrain
    from zerotrain.comm.distributed import device_for, init_distributed

    launch = init_distributed()
    device = device_for(launch.local_rank)
    hf_config = AutoConfig.for_model(**config_dict)
    fault_point("verify", number=ds["zero_optimization"]["stage"])  # a test's ZEROTRAIN_FAULT=verify:rankK:STAGE:oom
    with zerotrain.zero.Init(config_dict_or_path=ds, enabled=ds["zero_optimization"]["stage"] == 3):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention)
    from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing

    enable_gradient_checkpointing(model, checkpointing)  # False, "selective" or True
    if loss_chunk_tokens:
        from zerotrain.runtime.chunked_loss import enable_chunked_loss

        enable_chunked_loss(model, loss_chunk_tokens)
    engine, *_ = zerotrain.initialize(model=model, config=ds)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    saved = 0
    for _step in range(STEPS):
        for _micro in range(accumulation):
            tokens = torch.randint(0, hf_config.vocab_size, (micro, seq_len), device=engine.device)
            saved, loss = _forward_measuring_saved(engine, tokens)
            engine.backward(loss)
            engine.step()
    states = sum(engine.memory_breakdown().values())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result = {"oom": False, "model_states": states, "activations": saved, "peak_allocated": peak}
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _forward_measuring_saved(engine, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The loss, and the bytes of the distinct storages autograd saved for backward (parameters aside)."""
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters() if p.numel()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.numel() and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = t.untyped_storage().nbytes()
        return t

    from zerotrain.runtime.activation_checkpointing import kept_by_selective_checkpointing

    with kept_by_selective_checkpointing() as kept, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(input_ids=tokens, labels=tokens).loss
        storages.update((p, n) for p, n in kept().items() if p not in params)  # selective checkpointing's
    return sum(storages.values()), loss
