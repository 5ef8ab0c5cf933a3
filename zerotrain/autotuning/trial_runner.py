"""One tuning job's ranks: every trial in-process, one after the other, out-of-memory trials skipped together.

Each trial gets a process group of its own, created with a short timeout, and the engine's
collectives run on it (`collectives_on`). A rank that runs out of memory stops its trial; the
others, waiting for it in a collective, time out on that group instead of hanging. The ranks
then agree on each trial's outcome through the job's TCP store, not through a collective, and
the next trial starts on a fresh group.

After the first pass the leading trials run again (`noise.to_repeat`, at most `repeats` runs
each) until the leader's spread is clear of its runners-up or the limit is reached. Every rank
takes the same decisions: the timings are all-reduced and rank 0 alone reads the clock for the
time budget. A trial's stderr (library warnings, tracebacks) goes to its log file, not the console.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from zerotrain.autotuning.noise import to_repeat
from zerotrain.comm.fault_points import fault_point
from zerotrain.planning.local_job import recorded


@recorded
def run_trials(job: dict) -> list[dict]:
    """Every rank runs this; returns one record per experiment (rank 0's is the one kept)."""
    from zerotrain.comm.distributed import init_distributed

    with _stderr_to(log_path(job["results_dir"], None, int(os.environ.get("RANK", "0"))), fresh=True):
        launch = init_distributed(timeout_s=4 * job["trial_timeout_s"])
        rank, world = launch.rank, launch.world_size
        if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
            # CPU ranks share the cores: oversubscribed threads would make every timing noise.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        store = dist.distributed_c10d._get_default_store()
        records, started = _first_pass(job, rank, world, store)
        _repeat_leaders(job, records, started, rank, world, store)
        if dist.is_initialized():
            dist.destroy_process_group()
    return records


def _first_pass(job: dict, rank: int, world: int, store) -> tuple[list[dict], float]:
    records: list[dict] = []
    best, since_best, started = None, 0, time.monotonic()
    total = len(job["experiments"])
    for index, exp in enumerate(job["experiments"]):
        stop = _agree(store, f"zerotrain_tune/stop/{index}", rank,
                      lambda: _stop_reason(job, index, since_best, started))
        if stop:
            records.append({"name": exp["name"], "status": "not run", "reason": stop})
            continue
        record = _attempt(job, exp, index, str(index), rank, world, store, fresh_log=True)
        if record["status"] == "ok":
            record = {**record, "runs": [record["metrics"]]}
        records.append(record)
        if rank == 0:
            print(f"trial {index + 1}/{total} {exp['name']}: {_shown(job, record)}", flush=True)
        if record["status"] == "ok":
            value = record["metrics"][job["metric"]]
            better = best is None or (value < best if job["metric"] == "latency" else value > best)
            best, since_best = (value, 0) if better else (best, since_best + 1)
        else:
            since_best += 1
    return records, started


def _repeat_leaders(job: dict, records: list[dict], started: float, rank: int, world: int, store) -> None:
    """Runs the leading trials again, in place in `records`, until `noise.to_repeat` has none left."""
    by_name = {r["name"]: r for r in records}
    index_of = {e["name"]: i for i, e in enumerate(job["experiments"])}
    broken: set[str] = set()  # a repeat failed: its runs so far stand, it is not run again
    round_ = 0
    while True:
        samples = {n: [run[job["metric"]] for run in r["runs"]] for n, r in by_name.items() if r["status"] == "ok"}
        picks = [n for n in to_repeat(samples, job["metric"], job["repeats"]) if n not in broken]
        if not picks:
            return
        for name in picks:
            record, index = by_name[name], index_of[name]
            stop = _agree(store, f"zerotrain_tune/repeat_stop/{round_}/{name}", rank,
                          lambda: _budget_spent(job, started))
            if stop:
                if rank == 0:
                    print(f"repeats stopped: {stop}", flush=True)
                return
            run_no = len(record["runs"]) + 1
            outcome = _attempt(job, job["experiments"][index], index, f"{index}.{run_no}", rank, world, store,
                               fresh_log=False)
            if outcome["status"] == "ok":
                record["runs"].append(outcome["metrics"])
                record["metrics"] = _medians(record["runs"])
            else:
                broken.add(name)
                record["repeat_failed"] = outcome.get("reason", "")
            if rank == 0:
                print(f"repeat {run_no}/{job['repeats']} {name}: {_shown(job, outcome)}", flush=True)
        round_ += 1


def _attempt(job: dict, exp: dict, index: int, key: str, rank: int, world: int, store, fresh_log: bool) -> dict:
    """One timed run of `exp` on every rank; the record all ranks agree on."""
    from zerotrain.comm.distributed import collectives_on

    group = dist.new_group(timeout=timedelta(seconds=job["trial_timeout_s"]))
    status, metrics = "ok", {}
    with _stderr_to(log_path(job["results_dir"], exp["name"], rank), fresh=fresh_log):
        try:
            with collectives_on(group):
                metrics = _timed_trial(job, exp, index, rank, group)
        except (torch.OutOfMemoryError, MemoryError) as error:
            status = f"oom: {_first_line(error)}"
            traceback.print_exc()  # into the trial's log: the console gets the first line
        except Exception as error:  # noqa: BLE001 - a peer's failure seen as a timeout, or this trial's own error
            text = _first_line(error)
            status = f"oom: {text}" if "out of memory" in str(error) else f"failed: {type(error).__name__}: {text}"
            traceback.print_exc()
    gc.collect()
    store.set(f"zerotrain_tune/{key}/{rank}", status)
    statuses = [store.get(f"zerotrain_tune/{key}/{r}").decode() for r in range(world)]
    failed = [(r, s) for r, s in enumerate(statuses) if s != "ok"]
    if not failed:
        return {"name": exp["name"], "status": "ok", "metrics": metrics}
    # The rank that caused it: one out of memory, else one whose error is not a peer's timeout.
    cause = ([f for f in failed if f[1].startswith("oom")] or [f for f in failed if "timed out" not in f[1].lower()]
             or failed)[0]
    status = "oom" if cause[1].startswith("oom") else "failed"
    log = log_path(job["results_dir"], exp["name"], cause[0])
    detail = cause[1].split(": ", 1)[-1]  # the status word is the record's own field
    return {"name": exp["name"], "status": status, "reason": f"rank {cause[0]}: {detail}"[:300], "log": str(log)}


def log_path(results_dir: str, name: str | None, rank: int) -> Path:
    """Where a rank's stderr goes: `<results_dir>/<trial>/stderr.log` (rank 0), `stderr.rank<N>.log` (others);
    outside any trial (name None), `<results_dir>/stderr.log`."""
    folder = Path(results_dir) / name if name else Path(results_dir)
    return folder / ("stderr.log" if rank == 0 else f"stderr.rank{rank}.log")


@contextlib.contextmanager
def _stderr_to(path: Path, fresh: bool):
    """File descriptor 2 into `path`: Python's warnings, transformers' logging and torch's C++ messages
    all write there, so they land in the log instead of the tune console."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "w" if fresh else "a") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:200]


def _shown(job: dict, record: dict) -> str:
    if record["status"] == "ok":
        return f"ok {job['metric']} {record['metrics'][job['metric']]:.4g}"
    return f"{record['status']} {record.get('reason', '')} (log: {record.get('log', '-')})"


def _medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _agree(store, key: str, rank: int, decide) -> str:
    """Rank 0's `decide()`, the same on every rank (a clock read on each rank could differ)."""
    if rank == 0:
        store.set(key, decide())
    return store.get(key).decode()


def _stop_reason(job: dict, index: int, since_best: int, started: float) -> str:
    # Early stopping first: once it stopped the search, it is why every later trial did not run.
    if since_best >= job["early_stopping"]:
        return f"early stop: {since_best} trials without improvement"
    if index >= job["num_trials"]:
        return f"tuner_num_trials ({job['num_trials']}) reached"
    return _budget_spent(job, started)


def _budget_spent(job: dict, started: float) -> str:
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
    from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing

    enable_gradient_checkpointing(model, exp["gradient_checkpointing"])  # False, "selective" or True
    engine, *_ = zerotrain.initialize(model=model, config=ds)
    try:
        micro, accumulation = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        generator = torch.Generator().manual_seed(rank)

        def train_step() -> None:
            for _ in range(accumulation):
                fault_point("trial", number=index + 1)  # a test's ZEROTRAIN_FAULT=trial:rankK:N:oom (or fail)
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
