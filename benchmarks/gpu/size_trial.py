"""One trial of the size check, in a process of its own: build one engine on one rung, train 3 steps.

Run by size.py (never imported by it: a CUDA OOM, a host-memory kill or a hang ends this
process only). World of one: NCCL on the GPU, Gloo on the CPU (dry mode). Writes one JSON
file, `--out`, with status "ok" and the measurements, or "failed" and the reason.

The model recipe is the same for both engines: the Llama is built directly on the compute
device in bf16 (HF's seeded init runs there: seconds, never an fp32 model on the CPU), then
`initialize` with the shared config partitions it and moves what is offloaded to the CPU.
`--stage3-build init` builds the ZeRO-3 mode's model under the engine's own `zero.Init`
(zerotrain.zero.Init or deepspeed.zero.Init) instead, parameters partitioned as they are built;
zerotrain's replays the initializers on the CPU (single-threaded RNG), about a minute per
billion parameters, which the size check's budget cannot afford. Then Hugging Face gradient
checkpointing (non-reentrant), then `initialize`.

`--probe` prints the device and versions as JSON instead (size.py asks a child so that its own
process never holds a CUDA context the trials would lose memory to).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its high-water mark (VmHWM), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "zerotrain", "deepspeed"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def probe() -> dict:
    import torch

    info: dict = {"versions": _versions(), "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(device=props.name, gpu_total_bytes=total, gpu_free_bytes=free, cuda_version=torch.version.cuda)
    return info


def enable_checkpointing(model) -> None:
    """Non-reentrant HF gradient checkpointing (works with ZeRO-3's hooks in both engines)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def build_model(engine: str, stage: int, cfg, ds: dict, device, seed: int, zero_init: bool = False):
    """The Llama of this rung, as the module docstring describes; seeded."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    if stage == 3 and zero_init:
        if engine == "zerotrain":
            import zerotrain
            init = zerotrain.zero.Init(config_dict_or_path=ds)
        else:
            import deepspeed
            init = deepspeed.zero.Init(config_dict_or_path=ds)
        with init:
            return LlamaForCausalLM(cfg)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)


def initialize(engine: str, model, ds: dict):
    if engine == "zerotrain":
        import zerotrain
        return zerotrain.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]
    import deepspeed
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]


def classify(exc: BaseException) -> str:
    """A failure's short reason: "CUDA OOM", "host memory" (a CPU or pinned allocation failed) or "error".

    The caching allocator's GPU OOM says "CUDA out of memory. Tried to allocate"; a failed
    cudaHostAlloc (pinned host memory) surfaces as "CUDA error: out of memory", told apart by
    the innermost source line; the CPU allocator says "DefaultCPUAllocator: can't allocate".
    """
    text = f"{type(exc).__name__}: {exc}".lower()
    frames = traceback.extract_tb(exc.__traceback__)
    innermost = (frames[-1].line or "").lower() if frames else ""
    if "defaultcpuallocator" in text or "cannot allocate memory" in text or isinstance(exc, MemoryError):
        return "host memory"
    if "tried to allocate" in text and "out of memory" in text:
        return "CUDA OOM"
    if "out of memory" in text:
        return "host memory" if "pin" in innermost or "host" in text else "CUDA OOM"
    return "error"


def start_world_of_one(device) -> None:
    """This trial's threads (OMP_NUM_THREADS), device, and a default group of one: NCCL or Gloo."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=0, world_size=1)


def timed_steps(engine, batch_shape: tuple[int, int], vocab: int, args, device, result: dict, label: str) -> None:
    """args.steps training steps on seeded random tokens, each timed to the device's end; fills `result`
    with status "ok" (or "failed" on a non-finite loss), step times, losses, tokens/s and the GPU's peaks."""
    import torch

    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    times, losses = [], []
    for step in range(args.steps):
        result["phase"] = f"step {step + 1}"  # where a failure happened, for the caller's report
        ids = torch.randint(0, vocab, batch_shape, generator=gen).to(device)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        print(f"{label} step {step + 1}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)
    del result["phase"]
    timed = times[1:] or times  # step 1 warms up (allocates the optimizer state, autotunes kernels)
    result.update(status="ok", step_s=times, losses=losses, median_step_s=sorted(timed)[len(timed) // 2],
                  tokens_per_s=math.prod(batch_shape) * len(timed) / sum(timed))
    if cuda:
        result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        result["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if not all(math.isfinite(x) for x in losses):
        result.update(status="failed", reason="error", error=f"non-finite loss {losses}")


def record_baseline(result: dict, out: str) -> None:
    """The process's memory before the trial builds anything, in `result` and in OUT.baseline (for the
    driver's watcher, which judges the trial's growth against it)."""
    result["baseline_rss_bytes"] = rss_bytes()
    Path(out + ".baseline").write_text(str(result["baseline_rss_bytes"]))


def record_failure(result: dict, exc: BaseException, phase: str) -> None:
    """A trial's failure as its result: the class the driver reports, the phase it failed in, the error."""
    result.update(reason=classify(exc), phase=result.get("phase", phase), error=f"{type(exc).__name__}: {exc}"[-2000:])
    traceback.print_exc()


def closed(result: dict, t_start: float) -> dict:
    """`result` with the trial's host peak and wall time, whether it passed or failed."""
    result["host_peak_rss_bytes"] = rss_bytes("VmHWM")
    result["wall_s"] = time.perf_counter() - t_start
    return result


def write_result_and_exit(result: dict, out: str) -> None:
    """The result file, replaced whole; then exit without interpreter teardown (exit hooks of
    NCCL/DeepSpeed add seconds and can hang after an OOM): 0 when the trial trained, else 3."""
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["status"] == "ok" else 3)


def run(args) -> dict:
    import torch
    from size_ladder import ds_config, hf_config

    t_start = time.perf_counter()
    phase = "startup"
    result: dict = {"status": "failed", "engine": args.engine, "mode": args.mode, "size": args.size["name"]}
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        # Both engines reuse an initialized default group; one group for both keeps them alike.
        start_world_of_one(device)
        # The libraries' own memory belongs to the baseline, not to what the trial grows by.
        for lib in ("transformers", "zerotrain", *(("deepspeed",) if args.engine == "deepspeed" else ())):
            importlib.import_module(lib)
        record_baseline(result, args.out)
        ds = ds_config(args.mode, args.micro_batch)
        stage = ds["zero_optimization"]["stage"]
        cfg = hf_config(args.size, args.seq)
        phase = "build"
        t0 = time.perf_counter()
        model = build_model(args.engine, stage, cfg, ds, device, args.seed, args.stage3_build == "init")
        enable_checkpointing(model)
        phase = "initialize"
        engine = initialize(args.engine, model, ds)
        del model
        if cuda:
            torch.cuda.synchronize(device)
            result["gpu_build_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        result["build_s"] = time.perf_counter() - t0
        result["host_rss_after_build_bytes"] = rss_bytes()
        timed_steps(engine, (args.micro_batch, args.seq), cfg.vocab_size, args, device, result, "[size-trial]")
    except BaseException as exc:  # noqa: BLE001 - every failure is a result to report
        record_failure(result, exc, phase)
    return closed(result, t_start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", action="store_true")
    p.add_argument("--engine", choices=["zerotrain", "deepspeed"])
    p.add_argument("--mode")
    p.add_argument("--size", type=json.loads, help="the rung, as size_ladder.Size.as_dict() JSON")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--stage3-build", choices=["device", "init"], default="device")
    p.add_argument("--out")
    args = p.parse_args()
    if args.probe:
        print(json.dumps(probe()), flush=True)
        return
    write_result_and_exit(run(args), args.out)


if __name__ == "__main__":
    main()
