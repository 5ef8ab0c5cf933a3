"""The planner's prediction of the largest rung that fits, per mode, before anything runs.

zerotrain's planner (`zerotrain.planning.rung_memory.estimate_rung`, what `zerotrain estimate`
prints) gives each rung's bytes per GPU and on the host from the model's shapes alone: the
model is built on the meta device, nothing is allocated. A rung "fits" when its GPU total plus
the planner's reserve fits the GPU and its host total plus the host reserve fits what a trial
may take (MemAvailable less the harness's floor).

On a CPU device (dry mode) the "GPU" terms live in host memory too, so a rung fits there when
GPU and host terms together fit the (fake) host limit.

DeepSpeed's own estimator (`estimate_zero2/3_model_states_mem_needs`, DeepSpeed's formulas as
`zerotrain.planning.deepspeed_estimates` reproduces them byte for byte, with its default 1.5
buffer factor) predicts a largest rung too: DeepSpeed's search starts there.
"""

from __future__ import annotations

from typing import Any

from size_ladder import MODES, Size, ds_config, hf_config

GIB = 2**30


def _rung(mode: str):
    from zerotrain.planning.ladder import Rung

    stage, offload_param = MODES[mode]
    return Rung(stage, "cpu", "cpu" if offload_param else "none", gradient_checkpointing=True)


def estimate(size: Size, mode: str, seq: int, micro_batch: int, gpu_memory: int | None,
             host_memory: int | None, cpu_device: bool) -> dict[str, Any]:
    """The planner's bytes for one rung: GPU total (with its reserve), host total, and whether it fits."""
    import torch
    from transformers import LlamaForCausalLM

    from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(size, seq))
    hardware = Hardware(gpus_per_node=1, gpu_memory=None if cpu_device else gpu_memory,
                        cpu_memory=None if cpu_device else host_memory)
    est = estimate_rung(model, _rung(mode), Workload(seq, micro_batch, "bf16", "sdpa"), hardware,
                        ds_config(mode, micro_batch))
    gpu = est.gpu_total + est.gpu_reserve
    host = est.cpu_total
    if cpu_device:  # one memory holds everything
        fits = host_memory is None or est.gpu_total + host <= host_memory
        overflow = [] if fits else [(f"GPU + host terms {(est.gpu_total + host) / GIB:.3f} GiB "
                                     f"> host limit {host_memory / GIB:.3f} GiB")]
    else:
        fits, overflow = est.fits, list(est.overflow)
    return {"size": size.name, "gpu_bytes": gpu, "host_bytes": host, "fits": fits, "overflow": overflow,
            "gpu_terms": dict(est.gpu), "host_terms": dict(est.cpu_per_node)}


def predict(sizes: list[Size], mode: str, seq: int, micro_batch: int, gpu_memory: int | None,
            host_memory: int | None, cpu_device: bool) -> dict[str, Any]:
    """Estimates rungs from the smallest up until two in a row do not fit; the largest fitting is the prediction.

    Returns {"largest": name or None, "largest_index": n or 0, "sizes": {name: estimate}}.
    """
    rows: dict[str, Any] = {}
    largest, misses = None, 0
    for size in sizes:
        row = estimate(size, mode, seq, micro_batch, gpu_memory, host_memory, cpu_device)
        rows[size.name] = row
        if row["fits"]:
            largest, misses = size, 0
        else:
            misses += 1
            if misses == 2:
                break
    return {"largest": largest.name if largest else None, "largest_index": largest.index if largest else 0,
            "sizes": rows}


def deepspeed_predict(sizes: list[Size], mode: str, gpu_memory: int | None, host_memory: int | None,
                      cpu_device: bool) -> dict[str, Any]:
    """DeepSpeed's estimator: the largest rung whose CPU (and GPU) bytes fit, with DeepSpeed's 1.5 factor."""
    from zerotrain.planning.deepspeed_estimates import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs,
    )

    stage, offload_param = MODES[mode]
    rows: dict[str, Any] = {}
    largest = None
    for size in sizes:
        if stage == 2:
            cpu, gpu = estimate_zero2_model_states_mem_needs(size.params, 1, 1, cpu_offload=True)
        else:
            layer = size.vocab * size.hidden  # the largest module: the embedding (or the LM head)
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(size.params, layer, 1, 1, cpu_offload=True,
                                                                cpu_offload_params=offload_param)
        need_host = cpu + (gpu if cpu_device else 0)
        fits = (host_memory is None or need_host <= host_memory) and \
            (cpu_device or gpu_memory is None or gpu <= gpu_memory)
        rows[size.name] = {"cpu_bytes": cpu, "gpu_bytes": gpu, "fits": fits}
        if fits:
            largest = size
        else:
            break
    return {"largest": largest.name if largest else None, "largest_index": largest.index if largest else 0,
            "sizes": rows}
