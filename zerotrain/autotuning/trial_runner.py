"""One tuning job's ranks: every trial in-process, one after the other, out-of-memory trials skipped together.

Each trial gets a process group of its own, created with a short timeout, and the engine's
collectives run on it (`collectives_on`). A rank that runs out of memory stops its trial; the
others, waiting for it in a collective, time out on that group instead of hanging. The ranks
then agree on each trial's outcome through the job's TCP store, not through a collective, and
the next trial starts on a fresh group.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from zerotrain.planning.local_job import recorded

# Test-only: "TRIAL@RANK" makes that rank run out of memory in that trial's first forward.
INJECT_OOM_ENV = "ZEROTRAIN_TEST_TUNE_OOM"


@recorded
def run_trials(job: dict) -> list[dict]:
    """Every rank runs this; returns one record per trial attempted (rank 0's is the one kept)."""
    from zerotrain.comm.distributed import collectives_on, init_distributed

    launch = init_distributed(timeout_s=4 * job["trial_timeout_s"])
    rank, world = launch.rank, launch.world_size
    if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
        # CPU ranks share the cores: oversubscribed threads would make every timing noise.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    store = dist.distributed_c10d._get_default_store()
    records: list[dict] = []
    best, since_best, started = None, 0, time.monotonic()
    for index, exp in enumerate(job["experiments"]):
        stop = _stop_reason(job, index, since_best, started)
        if stop:
            records.append({"name": exp["name"], "status": "not run", "reason": stop})
            continue
        group = dist.new_group(timeout=timedelta(seconds=job["trial_timeout_s"]))
        status, metrics = "ok", {}
        try:
            with collectives_on(group):
                metrics = _timed_trial(job, exp, index, rank, group)
        except (torch.OutOfMemoryError, MemoryError) as error:
            status = f"oom: {error}"
        except RuntimeError as error:  # a peer's failure seen as a timeout, or "out of memory" text
            status = f"oom: {error}" if "out of memory" in str(error) else f"failed: {str(error)[:200]}"
        store.set(f"zerotrain_tune/{index}/{rank}", status)
        statuses = [store.get(f"zerotrain_tune/{index}/{r}").decode() for r in range(world)]
        record = {"name": exp["name"], "status": "ok", "metrics": metrics}
        if any(s != "ok" for s in statuses):
            failed = [(r, s) for r, s in enumerate(statuses) if s != "ok"]
            oom = [r for r, s in failed if s.startswith("oom")]
            record = {"name": exp["name"], "status": "oom" if oom else "failed",
                      "reason": f"rank {(oom or [failed[0][0]])[0]}: {dict(failed)[(oom or [failed[0][0]])[0]]}"[:300]}
        records.append(record)
        if rank == 0:
            shown = (f"{job['metric']} {record['metrics'][job['metric']]:.4g}" if record["status"] == "ok"
                     else record.get("reason", ""))
            print(f"trial {index + 1}/{len(job['experiments'])} {exp['name']}: {record['status']} {shown}", flush=True)
        gc.collect()
        if record["status"] == "ok":
            value = record["metrics"][job["metric"]]
            better = best is None or (value < best if job["metric"] == "latency" else value > best)
            best, since_best = (value, 0) if better else (best, since_best + 1)
        else:
            since_best += 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return records


def _stop_reason(job: dict, index: int, since_best: int, started: float) -> str:
    if index >= job["num_trials"]:
        return f"tuner_num_trials ({job['num_trials']}) reached"
    if since_best >= job["early_stopping"]:
        return f"early stop: {since_best} trials without improvement"
    if job["time_budget_s"] and time.monotonic() - started > job["time_budget_s"]:
        return f"time budget ({job['time_budget_s']:g} s) spent"
    return ""


def _timed_trial(job: dict, exp: dict, index: int, rank: int, group) -> dict:
    """Build the engine for `exp`, run `end_step` steps, time those from `start_step` on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zerotrain

    ds = {**exp["config"], "steps_per_print": 10**9}  # progress lines would be timed too
    hf_config = AutoConfig.for_model(**job["model_config"])
    torch.manual_seed(0)
    with zerotrain.zero.Init(config_dict_or_path=ds, enabled=ds["zero_optimization"]["stage"] == 3):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=job["attention"])
    if exp["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    engine, *_ = zerotrain.initialize(model=model, config=ds)
    try:
        micro, accumulation = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        generator = torch.Generator().manual_seed(rank)

        def train_step() -> None:
            for _ in range(accumulation):
                if os.environ.get(INJECT_OOM_ENV) == f"{index}@{rank}":
                    raise torch.OutOfMemoryError("out of memory (injected by a test)")
                ids = torch.randint(0, hf_config.vocab_size, (micro, job["seq_len"]), generator=generator)
                ids = ids.to(engine.device)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()

        for _ in range(job["start_step"] - 1):
            train_step()  # warm-up: first calls allocate, and the allocator settles
        # Timed in rounds of the profiled steps until `min_seconds` have passed on the slowest
        # rank: every rank takes the same decision from the same all-reduced time.
        steps, elapsed = 0, 0.0
        while elapsed < job["min_seconds"]:
            dist.barrier(group=group)
            begin = time.perf_counter()
            for _ in range(job["end_step"] - job["start_step"] + 1):
                train_step()
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            # On the engine's device: the trial group takes the default backend (NCCL on GPUs: no CPU tensors).
            took = torch.tensor([time.perf_counter() - begin], dtype=torch.float64, device=engine.device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
            elapsed += took.item()
            steps += job["end_step"] - job["start_step"] + 1
    finally:
        engine.destroy()
    per_step = elapsed / steps
    samples = job["global_batch"] / per_step
    return {"throughput": samples, "latency": per_step, "flops": 6 * job["num_params"] * samples * job["seq_len"]}
