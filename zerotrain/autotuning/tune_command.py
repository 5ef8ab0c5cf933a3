"""`zerotrain tune TRAIN_YAML`: time the configurations the memory model leaves, pick the fastest.

The train YAML gives the model, the sequence length and the global batch (micro-batch x
accumulation x ranks); its DeepSpeed section's `autotuning` keys steer the search (metric,
start/end_profile_step, tuner_early_stopping, tuner_num_trials, results_dir, exps_dir,
overwrite, fast, max_train_micro_batch_size_per_gpu). One job of N local ranks runs every trial
in-process (`trial_runner`), then repeats the leaders (`--repeats`) so the verdict can tell a
real lead from noise (`noise`); the results are written in DeepSpeed's layout (`results`), and
the winner is printed as the train YAML keys to set (`apply`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_tune_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `tune` to the `zerotrain` command."""
    from zerotrain.config.flag_spellings import GPUS_PER_NODE, add_shared_flag
    from zerotrain.planning.planning_args import memory_size, positive_int

    parser = subparsers.add_parser(
        "tune",
        help="time the ZeRO stage / offload / micro-batch candidates that fit, in one job, and pick the fastest",
        description="DeepSpeed's autotuner, in one job: the memory model prunes the candidates (stage, offload, "
        "checkpointing, micro-batch keeping the global batch, bucket sizes with fast: false), then every rank "
        "times them in-process, in the plan's order, with early stopping and a time budget. An out-of-memory "
        "trial is skipped on every rank together. Results go to autotuning_results/ as DeepSpeed writes them.",
    )
    parser.add_argument("config", metavar="TRAIN_YAML", help="a zerotrain train YAML (model, data.seq_len, batch)")
    add_shared_flag(parser, GPUS_PER_NODE, dest="num_gpus", type=positive_int, default=None, metavar="N",
                    help="ranks to tune on, on this machine (default: its GPUs, or 1 without)")
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="memory of one GPU for pruning (default: the GPU's own; none on a CPU)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no trial after this many seconds")
    parser.add_argument("--trial-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long a rank waits for a peer inside a trial before counting it failed (default 60)")
    parser.add_argument("--min-trial-seconds", type=float, default=1.0, metavar="SECONDS",
                        help="time each trial's profiled steps, repeated, for at least this long (default 1)")
    parser.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                        help="run the leading trials up to N times each, until the winner's lead is outside "
                        "the spread of its runs (default 3; 1: one run each, no spread)")
    from zerotrain.planning.speed_args import add_speed_args

    add_speed_args(parser)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--master_port", "--master-port", type=positive_int, default=None, metavar="PORT",
                        help="the ranks' rendezvous port (default: a free one)")
    parser.set_defaults(handler=run_tune)


def _predictions(args, candidates, model, hardware, seq_len: int, dtype: str, base: dict, cuda: bool):
    """({experiment: predicted seconds per step}, a line saying on what speeds) — empty on a CPU
    without `--compute`: GPU defaults would predict nothing about this machine's cores."""
    from zerotrain.planning.model_flops import model_flops
    from zerotrain.planning.rung_memory import Workload
    from zerotrain.planning.speed_args import rates_from_args
    from zerotrain.planning.step_time import predict_step

    if not cuda and not args.compute:
        return {}, "trials in the plan's order (give --compute FILE from `zerotrain bench compute` to order " \
                   "them by predicted step time)"
    rates, _ = rates_from_args(args, hardware.gpus_per_node)
    flops = model_flops(model, seq_len)
    out = {e.name: predict_step(model, e.rung, Workload(seq_len, e.micro_batch, dtype), hardware, rates,
                                e.accumulation, base, flops).step_s for e in candidates}
    return out, f"trials in predicted order ({rates.sources[-1]})"


def run_tune(args: argparse.Namespace) -> int:
    """0 when a trial ran (the winner written), 1 when none could, 2 for a wrong config."""
    import torch

    from zerotrain.autotuning.apply import apply_lines, winner_overrides
    from zerotrain.autotuning.results import check_result_dirs, write_results
    from zerotrain.autotuning.search_space import experiments
    from zerotrain.autotuning.trial_runner import run_trials
    from zerotrain.config import load_config
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.planning.local_job import run_local_job
    from zerotrain.planning.model_source import count_parameters, load_meta_model
    from zerotrain.planning.planner import make_plan
    from zerotrain.planning.rung_memory import Hardware
    from zerotrain.train.config_files import load_train_config

    try:
        cfg = load_train_config(Path(args.config))
        model = load_meta_model(args.config)
        base = dict(cfg.zero_dict())
        tuning = load_config(base).autotuning
        cuda = torch.cuda.is_available()
        world = args.num_gpus or (torch.cuda.device_count() if cuda else 1)
        gpu_memory = args.gpu_memory or (torch.cuda.get_device_properties(0).total_memory if cuda else None)
        hardware = Hardware(world, 1, gpu_memory)
        precision = cfg.training.precision
        dtype = {"auto": "bf16" if cuda else "fp32", "fp32": "fp32"}.get(precision, precision)
        global_batch = cfg.training.micro_batch_size * cfg.training.gradient_accumulation_steps * world
        seq_len = cfg.data.seq_len
        candidates, pruned = experiments(model, hardware, seq_len, global_batch, dtype, base, fast=tuning.fast,
                                         max_micro_batch=tuning.max_train_micro_batch_size_per_gpu)
        plan = make_plan(model, hardware, seq_len, global_batch, dtype) if gpu_memory else None
        predicted_s, speed_note = _predictions(args, candidates, model, hardware, seq_len, dtype, base, cuda)
        # Trials run in predicted order, fastest first (the ladder's order where nothing is predicted).
        candidates = sorted(candidates, key=lambda e: predicted_s.get(e.name, 0.0))
        results_dir, exps_dir = Path(tuning.results_dir), Path(tuning.exps_dir)
        check_result_dirs(results_dir, exps_dir, tuning.overwrite)  # before the trials, not after them
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as error:
        print_user_error("zerotrain tune", error)
        return USAGE_EXIT_CODE
    exps = [{"name": e.name, "config": e.deepspeed_config(base, seq_len, dtype, global_batch),
             "gradient_checkpointing": e.rung.gradient_checkpointing, "predicted_gpu_bytes": e.predicted_gpu_bytes,
             "predicted_step_s": predicted_s.get(e.name)}
            for e in candidates]
    job = {
        "experiments": exps, "model_config": model.config.to_dict(), "attention": "sdpa", "seq_len": seq_len,
        "global_batch": global_batch, "num_params": count_parameters(model)[0], "metric": tuning.metric,
        "start_step": tuning.start_step or tuning.start_profile_step,
        "end_step": tuning.end_step or tuning.end_profile_step,
        "early_stopping": tuning.tuner_early_stopping, "num_trials": tuning.tuner_num_trials,
        "time_budget_s": args.time_budget, "trial_timeout_s": args.trial_timeout,
        "min_seconds": args.min_trial_seconds, "repeats": args.repeats, "results_dir": str(results_dir),
    }
    print(f"zerotrain tune: {len(exps)} candidates on {world} rank{'s' if world > 1 else ''} "
          f"({len(pruned)} pruned by the memory model), metric {tuning.metric}; {speed_note}", flush=True)
    records = run_local_job(run_trials, world, job, name="zerotrain-tune", rank0_to_console=True,
                            master_port=args.master_port)[0]
    pruned_rows = [{"name": p.name, "reason": p.reason} for p in pruned]
    result = write_results(results_dir, exps_dir, exps, records, pruned_rows, tuning.metric)
    predicted = (f"{plan.choice.rung.name} at micro-batch {plan.choice.micro_batch}"
                 if plan and plan.choice else None)
    apply: list[str] = []
    pairs: list = []
    if result.winner is not None:
        winner = next(e for e in exps if e["name"] == result.winner)
        pairs, removals = winner_overrides(winner["config"], winner["gradient_checkpointing"], base)
        apply = apply_lines(result.winner, args.config, pairs, removals,
                            str(results_dir / "ds_config_optimal.json"), within_noise=bool(result.within_noise))
    if args.json:
        best = next((r for r in records if r["name"] == result.winner), None)
        print(json.dumps({"records": records, "pruned": pruned_rows, "best": best, "plan": predicted,
                          "verdict": {"winner": result.winner, "within_noise": list(result.within_noise),
                                      "lead_pct": result.lead_pct, "measured": result.measured, "text": result.text},
                          "overrides": {key: value for key, value in pairs}}, indent=2))
    else:
        print(Path(results_dir, "summary.txt").read_text(), end="")
        if result.winner is not None:
            print("\n".join(apply))
            print(f"The plan predicted {predicted or 'nothing (no --gpu-memory)'}. Library warnings and tracebacks: "
                  f"{results_dir}/<experiment>/stderr.log")
    return 0 if result.winner is not None else 1
