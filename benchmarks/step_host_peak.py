#!/usr/bin/env python
"""Host memory of an offloaded optimizer step: how much the step itself adds above the resident
states, in bytes per parameter (one process, Gloo, the CPU).

    python benchmarks/step_host_peak.py [--sub-group-size N] [--bucket N] [--steps 3] [--foreach]

Trains a 156M-parameter Llama (random weights) in bf16 at stage 2 with the optimizer offloaded to
the CPU, and around each `engine.step()` resets and reads the process's peak resident memory
(Linux: /proc/self/clear_refs and VmHWM), and times it. The first step also builds the optimizer
states. `--foreach` asks for torch's foreach AdamW instead of the fused CPU kernel zerotrain picks.
"""

from __future__ import annotations

import argparse
import os
import time


def _status_kib(field: str) -> int:
    text = open("/proc/self/status").read()
    return int(text.split(field + ":")[1].split()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sub-group-size", type=int, default=20_000_000)
    p.add_argument("--bucket", type=int, default=10_000_000, help="reduce_bucket_size (elements)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--foreach", action="store_true", help="AdamW with foreach=True (not fused)")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerotrain

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4))
    n = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, **({"foreach": True} if args.foreach else {})}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "sub_group_size": args.sub_group_size, "reduce_bucket_size": args.bucket}}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    ids = torch.randint(0, 32000, (1, 64))
    for step in range(args.steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        before = _status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        peak = _status_kib("VmHWM") * 1024
        print(f"step {step}: {n / 1e6:.0f}M parameters, resident before the step {before / 2**20:.0f} MiB, "
              f"the step's peak +{(peak - before) / 2**20:.0f} MiB ({(peak - before) / n:.2f} bytes/parameter), {seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
