"""One trial of the long-sequence part, in a process of its own: one shape, one mode, one length, 3 steps.

Run by longseq.py (never imported by it: a CUDA OOM or a host-memory kill ends this process
only). A world of one: NCCL on the GPU, Gloo on the CPU (dry mode). The model is built on the
compute device in bf16 (random weights, seeded), then the mode's switches go on in the order
`zerotrain train` applies them (zerotrain/train/trainer.py): checkpointing (non-reentrant), the
chunked loss, the tiled MLP, activation offload; then `zerotrain.initialize` with the planner's
ZeRO-3 config. Writes one JSON file, `--out`: status "ok" with step times and peak memory, or
"failed" with the reason (size_trial.classify's: "CUDA OOM", "host memory" or "error").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from size_trial import (
    closed, enable_checkpointing, record_baseline, record_failure, start_world_of_one, timed_steps, write_result_and_exit,
)


def build(shape: dict, sw: dict, seq: int, device, seed: int):
    """The mode's model on `device`, in bf16, with its switches on (see the module docstring)."""
    import torch
    from transformers import LlamaForCausalLM

    from longseq_shapes import hf_config

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config(shape, seq))
    finally:
        torch.set_default_dtype(default)
    enable_checkpointing(model)
    if sw["loss_chunk_tokens"]:
        from zerotrain.runtime.chunked_loss import enable_chunked_loss
        enable_chunked_loss(model, sw["loss_chunk_tokens"])
    if sw["tiled_mlp"]:
        from zerotrain.runtime.tiled_mlp import enable_tiled_mlp
        enable_tiled_mlp(model, None if sw["tiled_mlp"] is True else sw["tiled_mlp"])
    if sw["offload_activations"]:
        from zerotrain.runtime.activation_offload import enable_activation_offload
        enable_activation_offload(model)
    return model


def run(args) -> dict:
    import torch

    import zerotrain

    t_start = time.perf_counter()
    phase = "startup"
    result: dict = {"status": "failed", "seq": args.seq}
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        start_world_of_one(device)
        import transformers  # noqa: F401 - its memory belongs to the baseline, not to the trial's growth

        record_baseline(result, args.out)
        phase = "build"
        model = build(args.shape, args.switches, args.seq, device, args.seed)
        phase = "initialize"
        engine = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=args.config)[0]
        del model
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        timed_steps(engine, (1, args.seq), args.shape["vocab"], args, device, result, f"[longseq-trial] seq {args.seq}")
    except BaseException as exc:  # noqa: BLE001 - every failure is a result to report
        record_failure(result, exc, phase)
    return closed(result, t_start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=json.loads, required=True, help="longseq_shapes.Shape.as_dict() as JSON")
    p.add_argument("--switches", type=json.loads, required=True, help="longseq_shapes.switches() as JSON")
    p.add_argument("--config", type=json.loads, required=True, help="the DeepSpeed-format config, JSON")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    write_result_and_exit(run(args), args.out)


if __name__ == "__main__":
    main()
