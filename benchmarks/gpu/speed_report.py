"""The speed check's numbers: per engine and checkpointing mode, the targets, JSON and markdown.

tokens/s = world x micro-batch x seq / median step time. MFU = model FLOPs per step and GPU
(forward + backward, `speed_expect`, scaled to the column's micro-batch) / median step time / the
GPU's dense bf16 peak; HFU adds the forward checkpointing recomputes. GPU idle: the share of the
profiled step's wall time the GPU ran nothing. Compile: the first step less the median one
(speed_variants). Peak memory against the planner's prediction of the same ZeRO stage (plain torch
set against stage 0, FSDP2 against stage 3). The targets are speed_targets.py's.
"""

from __future__ import annotations

from speed_targets import targets

GIB = 2**30
LOSS_NOTE = 0.02  # a final loss this far (relative) from plain torch's gets a note


def derive(r: dict, args, flops, peak_tflops: float | None, predicted: int | None, checkpointing: bool) -> dict:
    """A row's figures from a worker's raw result (rows that failed pass through)."""
    if not r.get("ok"):
        return {"ok": False, "skipped": r.get("skipped", False), "reason": r.get("reason", "?")}
    step_s = r["median_step_s"]
    tl = r.get("timeline", {})
    mb, world = r.get("micro_batch", args.micro_batch), r.get("world_size", 1)
    profiled_ms = r.get("step_s_profiled", 0) * 1e3
    busy = tl.get("gpu_busy_ms")
    row = {
        "ok": True, "micro_batch": mb, "world_size": world,
        "tokens_per_s": world * mb * args.seq / step_s,
        "step_ms": step_s * 1e3,
        "gpu_idle_share": 1 - busy / profiled_ms if busy is not None and profiled_ms > 0 else None,
        "compile_s": r.get("compile_s"), "dynamo": r.get("dynamo"),
        "phase_ms": {k: v * 1e3 for k, v in r["phase_median_s"].items()},
        "mfu": None, "hfu": None,
        "exposed_comm_ms": tl.get("exposed_comm_ms"), "comm_ms": tl.get("comm_ms"),
        "gpu_idle_ms": tl.get("gpu_idle_ms"), "gpu_busy_ms": tl.get("gpu_busy_ms"),
        "timeline_note": tl.get("note"), "profiled_step_ms": profiled_ms,
        "peak_gib": r["peak_bytes"] / GIB,
        "phase_peak_gib": {k: v / GIB for k, v in r["phase_peak_bytes"].items()},
        "reserved_gib": r["reserved_bytes"] / GIB if r.get("reserved_bytes") is not None else None,
        "baseline_gib": r["baseline_bytes"] / GIB,
        "planner_gib": predicted / GIB if predicted else None,
        "peak_over_planner": r["peak_bytes"] / predicted if predicted else None,
        "loss_first": r["losses"][0], "loss_final": r["losses"][-1],
        "losses": r["losses"], "step_series_ms": [t * 1e3 for t in r["step_times_s"]],
        "seconds": r.get("seconds"), "process_wall_s": r.get("process_wall_s"), "info": r.get("info"),
        "memory_method": r.get("memory_method"),
        "engine_breakdown_gib": {k: v / GIB for k, v in (r.get("engine_breakdown") or {}).items()} or None,
        "engine_breakdown_bytes": r.get("engine_breakdown"),
        "engine_breakdown_by_rank": r.get("engine_breakdown_by_rank"),
    }
    if flops is not None and peak_tflops:
        scale = mb / args.micro_batch  # FLOPs grow with the micro-batch, seq fixed
        row["mfu"] = flops.model * scale / step_s / (peak_tflops * 1e12)
        row["hfu"] = flops.hardware(checkpointing) * scale / step_s / (peak_tflops * 1e12)
    return row


def build_report(args, meta: dict, results: dict[str, dict[str, dict]], flops, predictions: dict) -> dict:
    """speed.json's content: meta, job, FLOPs, every row, the targets and notes."""
    from speed_expect import prediction_key
    from speed_variants import parse_variant
    from workload import param_count

    rows = {engine: {mode: derive(r, args, flops, meta["peak_tflops"],
                                  predictions.get(prediction_key(engine, mode, args.micro_batch)), mode == "on")
                     for mode, r in by_mode.items()}
            for engine, by_mode in results.items()}
    notes = []
    for engine, by_mode in rows.items():
        plain = "plain-mb2" if parse_variant(engine).micro_batch else "plain"  # the same batches
        for mode, r in by_mode.items():
            ref = rows.get(plain, {}).get(mode, {})
            if r.get("ok") and ref.get("ok") and engine != plain and \
                    abs(r["loss_final"] - ref["loss_final"]) > LOSS_NOTE * abs(ref["loss_final"]):
                notes.append(f"{engine} (checkpointing {mode}): final loss {r['loss_final']:.3f} differs from "
                             f"{plain}'s {ref['loss_final']:.3f} by more than {LOSS_NOTE:.0%}")
            if r.get("ok") and args.device == "cuda" and r["baseline_gib"] > 0.05:
                notes.append(f"{engine} (checkpointing {mode}): {r['baseline_gib']:.2f} GiB were still allocated from "
                             "the earlier mode in the process; left out of its peak")
    timeline_notes: dict[str, list[str]] = {}
    optimizers: dict[str, str] = {}
    for engine, by_mode in rows.items():
        for mode, r in by_mode.items():
            if r.get("ok") and r["timeline_note"]:
                timeline_notes.setdefault(r["timeline_note"], []).append(f"{engine} {mode}")
            if r.get("ok") and (r.get("info") or {}).get("optimizer"):
                optimizers.setdefault(engine, r["info"]["optimizer"])
    ran = sum(1 for by_mode in rows.values() for r in by_mode.values() if r.get("ok"))
    notes += [f"exposed communication: {note} ({'every column' if len(where) == ran else ', '.join(where)})"
              for note, where in timeline_notes.items()]
    if optimizers:
        notes.append("optimizer as each engine built it: " + ", ".join(f"{e} {o}" for e, o in optimizers.items()))
    tgts = targets(rows, args.mode_list, meta["peak_source"])
    zerotrain_ok = all(r.get("ok") for e, m in rows.items() if e.startswith("zerotrain") for r in m.values())
    job = {
        "model_config": args.model_config, "parameters": param_count(args),
        "sizes": {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads")},
        "seq": args.seq, "micro_batch": args.micro_batch, "tokens_per_step": args.seq * args.micro_batch,
        "dtype": args.dtype, "attention": "sdpa", "warmup": args.warmup, "steps": args.steps,
        "mem_steps": args.mem_steps, "engines_per_process": args.engines_per_process, "world_size": args.world,
        "compile_backend": args.compile_backend,
        "seed": args.seed, "lr": args.lr, "clip": args.clip,
        "optimizer": "torch.optim.AdamW (foreach); DeepSpeed and zerotrain from the same config with torch_adam",
    }
    flops_info = None if flops is None else {
        "method": flops.method, "model_flops_per_step": flops.model, "recompute_flops_per_step": flops.recompute,
        "analytic_model_flops_per_step": flops.analytic_model,
        "counted_over_analytic": flops.model / flops.analytic_model if flops.analytic_model else None}
    return {"meta": meta, "job": job, "flops": flops_info,
            "planner_gib": {k: (v / GIB if v else None) for k, v in predictions.items()},
            "results": rows, "targets": tgts, "zerotrain_ok": zerotrain_ok, "notes": notes, "methods": METHODS}


METHODS = {
    "step_time": "median over the timed steps of forward + backward + optimizer step, each phase timed with "
                 "time.perf_counter between device synchronizations (torch.cuda.synchronize)",
    "gpu_idle": "1 - (union of all GPU activity) / the profiled step's wall time (host time the GPU waited for)",
    "compile": "the first step's forward + backward + step (each between device synchronizations) less the median "
               "step; graphs and graph breaks from torch._dynamo's counters over the column",
    "exposed_comm": "one extra step under torch.profiler (CUDA activity only): union of NCCL kernel intervals minus "
                    "the union of all other kernels, memcpys and memsets on the GPU timeline",
    "peak_memory": "torch.cuda.max_memory_allocated over each phase of the memory-measuring step, minus "
                   "memory_allocated before the mode built its model (CPU runs: RSS high-water mark, see worker.py)",
    "planner": "zerotrain.planning.rung_memory.estimate_rung(...).gpu_total for the rung (stage, checkpointing, "
               "micro-batch, bf16, SDPA, one GPU); plain torch is set against stage 0 and FSDP2 against stage 3",
}


def _processes(per_process: int) -> str:
    return "one process per engine" if per_process == 1 else f"{per_process} engines per process, one after the other"


def _params(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _flop(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} FLOP"


def _cell(text: str) -> str:
    """Text made safe for one markdown table cell: one line, no column breaks."""
    return " ".join(text.split()).replace("|", "/")


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _f(v, fmt: str, dash: str = "-") -> str:
    return dash if v is None else format(v, fmt)


def progress_line(engine: str, mode: str, r: dict, args, flops, peak, predicted) -> str:
    """One line printed as a mode's result arrives."""
    if not r.get("ok"):
        return f"{engine:<12} checkpointing {mode:<3}: FAILED {r.get('reason', '?')[:300]}"
    row = derive(r, args, flops, peak, predicted, mode == "on")
    p = row["phase_ms"]
    return (f"{engine:<12} checkpointing {mode:<3}: {row['tokens_per_s']:,.0f} tokens/s"
            + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
            + f", step {row['step_ms']:.1f} ms (fwd {p['forward']:.1f} / bwd {p['backward']:.1f} / opt {p['step']:.1f})"
            + f", exposed comm {_f(row['exposed_comm_ms'], '.2f')} ms"
            + (f", GPU idle {row['gpu_idle_share']:.0%}" if row["gpu_idle_share"] is not None else "")
            + (f", compile {row['compile_s']:.1f} s" if "-compile" in engine and row["compile_s"] is not None else "")
            + f", peak {row['peak_gib']:.2f} GiB"
            + (f" (planner {row['planner_gib']:.2f}, {row['peak_over_planner']:.2f}x)" if row["planner_gib"] else "")
            + f", loss {row['loss_first']:.3f} -> {row['loss_final']:.3f} [{r.get('wall_s', 0):.0f}s]")


HEADERS = ["engine", "checkpointing", "micro-batch", "tokens/s", "MFU", "HFU", "step ms", "fwd / bwd / opt ms",
           "exposed comm ms (all comm)", "GPU idle ms (% of step)", "compile s (graphs / breaks)", "peak GiB",
           "planner GiB", "peak / planner", "loss first -> final"]


def _compile_cell(engine: str, r: dict) -> str:
    if "-compile" not in engine:
        return "eager"
    d = r.get("dynamo") or {}
    return f"{_f(r['compile_s'], '.1f')} ({d.get('graphs', '?')} / {d.get('graph_breaks', '?')})"


def _row_cells(engine: str, mode: str, r: dict) -> list[str]:
    if not r.get("ok"):
        word = "not run" if r.get("skipped") else "FAILED"
        return [engine, mode, _cell(f"{word}: {r['reason'][:160]}")] + [""] * (len(HEADERS) - 3)
    p = r["phase_ms"]
    return [
        engine, mode, str(r["micro_batch"]), f"{r['tokens_per_s']:,.0f}", _f(r["mfu"], ".1%"), _f(r["hfu"], ".1%"),
        f"{r['step_ms']:.1f}", f"{p['forward']:.1f} / {p['backward']:.1f} / {p['step']:.1f}",
        f"{_f(r['exposed_comm_ms'], '.2f')} ({_f(r['comm_ms'], '.2f')})",
        f"{_f(r['gpu_idle_ms'], '.1f')} ({_f(r['gpu_idle_share'], '.0%')})", _compile_cell(engine, r),
        f"{r['peak_gib']:.2f}", _f(r["planner_gib"], ".2f"), _x(r["peak_over_planner"]),
        f"{r['loss_first']:.3f} -> {r['loss_final']:.3f}",
    ]


def markdown(rep: dict) -> str:
    """speed.md: the tables for docs/benchmarks.md, with the device and the command that made them."""
    m, j, fl = rep["meta"], rep["job"], rep["flops"]
    v = m["versions"]
    peak = f"dense bf16 peak {m['peak_tflops']:.0f} TFLOP/s ({m['peak_source']})" if m["peak_tflops"] \
        else m["peak_source"]
    s = j["sizes"]
    lines = [
        f"### GPU check: speed{' (dry run)' if m['dry'] else ''} on {m['device']}", "",
        *([] if m["complete"] else ["**Partial report: the run was still going or was interrupted.**", ""]),
        f"Command: `{m['command']}` ({m['date']}, {m['wall_s']:.0f} s)", "",
        (f"Device: {m['device']}; {peak}. torch {v['torch']}, transformers {v['transformers']}, zerotrain "
         f"{v['zerotrain']} @ {v['zerotrain_commit'] or '?'}, DeepSpeed {v['deepspeed'] or 'not installed'}, "
         f"Python {v['python']}."), "",
        (f"Job: Llama, {_params(j['parameters'])} parameters ({j['model_config'].split('/')[-1]}"
         f"{', sizes ' + str(s) if m['dry'] else ''}), random weights, {j['dtype']}, SDPA, seq {j['seq']}, "
         f"micro-batch {j['micro_batch']} ({m['micro_batch_reason']}), {j['tokens_per_step']:,} tokens/step, "
         f"{j['optimizer']}, clipping {j['clip']}; {j['warmup']} warm-up + {j['steps']} timed steps per engine "
         f"and mode; {_processes(j.get('engines_per_process', 1))}, a world of {j['world_size']} per column "
         f"({m.get('backend') or 'NCCL on a GPU, Gloo on a CPU'}); -compile columns: torch.compile backend "
         f"{j.get('compile_backend')}."), "",
        (f"FLOPs per step: {_flop(fl['model_flops_per_step'])} forward + backward (MFU), "
         f"+{_flop(fl['recompute_flops_per_step'])} recomputed with checkpointing (HFU); {fl['method']}."
         if fl else "FLOPs per step: not counted yet (partial report)."), "",
        "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS),
    ]
    for engine, by_mode in rep["results"].items():
        reasons = {r.get("reason") for r in by_mode.values() if not r.get("ok")}
        if len(by_mode) > 1 and len(reasons) == 1 and not any(r.get("ok") for r in by_mode.values()):
            # One row for an engine that ran in no mode for one reason (e.g. DeepSpeed not installed).
            by_mode = {", ".join(by_mode): next(iter(by_mode.values()))}
        lines += ["| " + " | ".join(_row_cells(engine, mode, r)) + " |" for mode, r in by_mode.items()]
    lines += ["", "| target | measured | ratio | verdict |", "|---|---|---|---|"]
    for t in rep["targets"]:
        value = _f(t["value"], ".1%") if "MFU" in t["target"] or "idle" in t["target"] else _x(t["value"])
        lines.append(f"| {t['target']} | {t['measured']} | {value} | **{_cell(t['verdict'])}** |")
    lines += ["", *(f"- {k.replace('_', ' ')}: {text}" for k, text in rep["methods"].items())]
    lines += [f"- note: {_cell(n)}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"
