"""The planner's answer for each shape and mode before anything runs: which ZeRO-3 rung, and how long a sequence.

`zerotrain plan MODEL --max-seq-len` (zerotrain.planning.longest_sequence) gives, for every rung of
its ladder, the longest sequence at micro-batch 1 whose memory fits this machine's GPU and host
memory with the mode's switches. The part runs ZeRO-3 with checkpointing, so it takes the
stage-3 checkpointed rung with the longest answer (ties: the earlier, i.e. less offloaded, rung):
that rung's offload is "what the host memory allows", and its length the predicted maximum that
the measured one is held against. The model is built on the meta device: nothing is allocated.

In dry mode the "GPU" is the CPU and its memory the fake limit; the planner's lengths come in
steps of 1,024 tokens (longest_sequence.GRAIN), longer than the dry lengths, so there its
prediction is printed but means nothing.
"""

from __future__ import annotations

from typing import Any

from longseq_shapes import Shape, base_ds_config, hf_config, switches


def plan(shape: Shape, mode: str, gpu_memory: int | None, host_memory: int | None, dry: bool) -> dict[str, Any]:
    """{"rung": {...} | None, "predicted_max": tokens, "config": the rung's DeepSpeed config, "per_rung": {...}}."""
    import torch
    from transformers import LlamaForCausalLM

    from zerotrain.planning.activation_memory import LongSequence
    from zerotrain.planning.longest_sequence import longest_sequence
    from zerotrain.planning.rung_memory import Hardware, Workload, rung_config

    sw = switches(mode, dry)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(shape, 2048))
    workload = Workload(2048, 1, "bf16", "sdpa", loss_chunk_tokens=sw["loss_chunk_tokens"],
                        long_sequence=LongSequence(1, sw["tiled_mlp"], sw["offload_activations"]))
    hardware = Hardware(gpus_per_node=1, gpu_memory=gpu_memory, cpu_memory=host_memory)
    answer = longest_sequence(model, hardware, workload, base_ds_config(), checkpointing=True)
    stage3 = [r for r in answer.rungs if r.rung.stage == 3 and r.rung.gradient_checkpointing is True]
    best = max(stage3, key=lambda r: r.seq_len, default=None)  # max keeps the first of equals
    # No stage-3 rung fits even 1,024 tokens (dry mode's tiny memory): run the plain ZeRO-3 rung anyway.
    rung = best.rung if best and best.seq_len else stage3[0].rung
    return {
        "rung": {"name": rung.name, "stage": rung.stage,
                 "offload_optimizer": rung.offload_optimizer, "offload_param": rung.offload_param},
        "predicted_max": best.seq_len if best else 0,
        "config": rung_config(rung, workload, base_ds_config()),
        "per_rung": {r.rung.name: r.seq_len for r in stage3},
    }

