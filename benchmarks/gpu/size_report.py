"""size.json and size.md of the size check: results per mode and engine, the target, every trial.

The markdown is written to be pasted into docs/benchmarks.md as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from size_ladder import DRY_SHAPE, GPU_SHAPE, MODE_TITLES

GIB = 2**30


def summarize(search) -> dict[str, Any]:
    """One engine in one mode: largest size trained, its tokens/s, the first failing size and why."""
    ok, bad = search.largest_ok(), search.first_failing()
    by_index = {t["index"]: t for t in search.trials}
    best = by_index.get(ok)
    failing = by_index.get(bad)
    return {
        "start": search.sizes[search.start - 1].name, "start_note": search.start_note, "done": search.done,
        "largest": best["size"] if best else None, "largest_params": best["params"] if best else None,
        "tokens_per_s_at_largest": best.get("tokens_per_s") if best else None,
        "first_failing": failing["size"] if failing else None,
        "first_failing_reason": failing["reason"] if failing else None,
        "first_failing_detail": failing.get("detail") if failing else None,
    }


def targets(searches) -> list[dict[str, Any]]:
    """Per mode: zerotrain's largest >= DeepSpeed's, and its tokens/s >= DeepSpeed's at the largest both trained."""
    out = []
    for mode in dict.fromkeys(s.mode for s in searches):
        zt = next((s for s in searches if s.mode == mode and s.engine == "zerotrain"), None)
        ds = next((s for s in searches if s.mode == mode and s.engine == "deepspeed"), None)
        row: dict[str, Any] = {"mode": mode, "verdict": "n/a"}
        if zt is None or ds is None:
            row["detail"] = "needs both engines"
            out.append(row)
            continue
        z, d = zt.largest_ok(), ds.largest_ok()
        row.update(zerotrain_largest=_name(zt, z), deepspeed_largest=_name(ds, d))
        if z is None or d is None:
            row["detail"] = "an engine trained no size"
            out.append(row)
            continue
        # A search that stopped (budget, ladder top) before a size failed knows only a lower bound.
        z_exact, d_exact = zt.first_failing() is not None, ds.first_failing() is not None
        row["lower_bound"] = [s.engine for s, exact in ((zt, z_exact), (ds, d_exact)) if not exact]
        row["size_met"] = (True if d_exact else None) if z >= d else (False if z_exact else None)
        common = max(set(zt.ok()) & set(ds.ok()), default=None)
        if common is not None:
            zr = next(t for t in zt.trials if t["index"] == common and t["status"] == "ok")
            dr = next(t for t in ds.trials if t["index"] == common and t["status"] == "ok")
            row.update(compared_at=zr["size"], zerotrain_tokens_per_s=zr["tokens_per_s"],
                       deepspeed_tokens_per_s=dr["tokens_per_s"], speed_ratio=zr["tokens_per_s"] / dr["tokens_per_s"],
                       speed_met=zr["tokens_per_s"] >= dr["tokens_per_s"])
        size_met, speed = row["size_met"], row.get("speed_met")
        row["verdict"] = "NOT met" if size_met is False or speed is False else (
            "met" if size_met and speed else "n/a")
        if common is None:
            row["detail"] = "no size trained by both: tokens/s not compared"
        if row["lower_bound"]:
            row["verdict"] += f" ({' and '.join(row['lower_bound'])}: largest is a lower bound, no failing size reached)"
        out.append(row)
    return out


def _name(search, index) -> str | None:
    return search.sizes[index - 1].name if index else None


def write_outputs(args, facts, limits, sizes, plan, searches, notes, elapsed, command) -> None:
    results: dict[str, dict[str, Any]] = {}
    for s in searches:
        results.setdefault(s.mode, {})[s.engine] = summarize(s)
    shape = DRY_SHAPE if args.dry else GPU_SHAPE
    data = {
        "check": "size", "dry": args.dry, "command": command, "device": facts["device"], "machine": facts,
        "workload": {"seq": args.seq, "micro_batch": 1, "steps": args.steps, "dtype": "bf16",
                     "gradient_checkpointing": True, "attention": "sdpa", "optimizer": "torch AdamW on the CPU",
                     "stage3_build": args.stage3_build,
                     "shape": vars(shape)},
        "limits": {"host_limit_bytes": limits.host_limit_bytes, "floor_bytes": limits.floor_bytes,
                   "rss_limit_bytes": limits.rss_limit_bytes, "trial_timeout_s": limits.trial_timeout_s},
        "budget_s": args.budget_s, "elapsed_s": round(elapsed, 1),
        "ladder": [s.as_dict() for s in sizes],
        "planner": plan, "results": results, "targets": targets(searches),
        "trials": sorted((t for s in searches for t in s.trials), key=lambda t: t.get("order", 0)), "notes": notes,
    }
    out = Path(args.out_dir)
    (out / "size.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "size.md").write_text(markdown(data, searches))


def _mem(n, dry: bool) -> str:
    """GiB on the GPU machine, MiB for a dry run's tiny sizes."""
    if not n:
        return "-"
    return f"{n / 2**20:.0f}" if dry else f"{n / GIB:.2f}"


def _size(t: dict, unit: float) -> str:
    return f"{t['size']} ({t['params'] / unit:.2f})"


def markdown(data: dict, searches) -> str:
    m, dry = data["machine"], data["dry"]
    unit = 1e6 if dry else 1e9
    mem = "MiB" if dry else "GiB"
    v = m["versions"]
    gpu = f", {m['gpu_total_bytes'] / GIB:.1f} GiB GPU memory" if m.get("gpu_total_bytes") else ""
    sh = data["workload"]["shape"]
    lines = [
        "### Largest Llama that trains with CPU offload" + (" (dry run: CPU, tiny sizes)" if dry else ""), "",
        f"{data['device']}{gpu}, {m['host_mem_total_bytes'] / GIB:.1f} GiB host memory (MemTotal), {m['cores']} CPU "
        f"cores; torch {v.get('torch')}, transformers {v.get('transformers')}, zerotrain {v.get('zerotrain')} "
        f"({m.get('commit')}), DeepSpeed {v.get('deepspeed') or 'not installed'}. Whole search: {data['elapsed_s']:.0f} s.",
        "",
        f"Llama sizes in steps of ~1{sh['unit_name']} parameters: one layer shape (hidden {sh['hidden']}, MLP "
        f"{sh['intermediate']}, {sh['heads']} heads, vocab {sh['vocab']}, untied embeddings), layers chosen so that "
        f"size n has about n{sh['unit_name']} parameters. bf16, seq {data['workload']['seq']}, micro-batch 1, "
        f"gradient checkpointing, {data['workload']['steps']} steps on synthetic tokens (tokens/s over steps 2-"
        f"{data['workload']['steps']}), one device (a world of one). Both engines get the same DeepSpeed config and "
        "step the same torch AdamW on the CPU (`torch_adam: true`); offload buffers pinned; the model is built "
        + ("on the device in bf16, then `initialize` offloads it" if data["workload"]["stage3_build"] == "device"
           else "on the device in bf16 at ZeRO-2, under each engine's `zero.Init` at ZeRO-3")
        + ". zerotrain's search starts at its planner's prediction, DeepSpeed's at its own estimator's "
        "(`estimate_zero2/3_model_states_mem_needs`, buffer factor 1.5), the ZeRO-3 mode at most at the ZeRO-2 "
        "mode's measured largest (offloading parameters adds host memory); "
        + ("it steps by one size. " if dry else
           "after a success it jumps to the largest size the measured host peaks extrapolate to (and refuses, "
           "unrun, one extrapolated over the limit by more than 3%), after a first failure it drops to "
           "DeepSpeed's estimate, else it steps by one size. ")
        + "A size \"trains\" when "
        f"its {data['workload']['steps']} steps finish within the host memory "
        f"({data['limits']['host_limit_bytes'] / GIB:.2f} GiB for a trial) and the GPU's. Each trial is a fresh process.",
        "",
        "| mode | engine | largest that trained (params) | tokens/s there | first that failed: why | "
        "predicted largest: zerotrain planner / DeepSpeed estimator |",
        "| --- | --- | --- | ---: | --- | --- |",
    ]
    for mode, engines in data["results"].items():
        for engine, r in engines.items():
            largest = f"**{r['largest']}** ({r['largest_params'] / unit:.2f})" if r["largest"] else "none"
            tps = f"{r['tokens_per_s_at_largest']:.0f}" if r["tokens_per_s_at_largest"] else "-"
            why = "refused (extrapolated host memory)" if r["first_failing_reason"] == "refused" else \
                r["first_failing_reason"]
            failed = f"{r['first_failing']}: {why}" if r["first_failing"] else f"- ({r['done']})"
            p = data["planner"][mode]
            lines.append(f"| {MODE_TITLES[mode]} | {engine} | {largest} | {tps} | {failed} | "
                         f"{p['largest'] or 'none'} / {p['deepspeed_estimator']['largest'] or 'none'} |")
    lines += ["", "Target: zerotrain reaches at least the size DeepSpeed reaches, at no lower tokens/s "
              "(compared at the largest size both trained).", "",
              "| mode | zerotrain largest | DeepSpeed largest | tokens/s zerotrain / DeepSpeed (at) | verdict |",
              "| --- | --- | --- | --- | --- |"]
    for t in data["targets"]:
        speed = (f"{t['zerotrain_tokens_per_s']:.0f} / {t['deepspeed_tokens_per_s']:.0f} = {t['speed_ratio']:.2f}x "
                 f"({t['compared_at']})") if "compared_at" in t else t.get("detail", "-")
        lines.append(f"| {MODE_TITLES[t['mode']]} | {t.get('zerotrain_largest') or '-'} | "
                     f"{t.get('deepspeed_largest') or '-'} | {speed} | {t['verdict']} |")
    lines += ["", "Every trial, in the order run (host peak: " + (
        "the trial's RSS growth over its baseline after imports" if dry else
        "the machine's used memory (MemTotal - MemAvailable) over its value before the trial, pinned buffers included")
        + "; planner: zerotrain's `estimate_rung` for this machine, GPU including its reserve):", "",
        f"| mode | engine | size (params) | result | tokens/s | step s | GPU peak {mem} | host peak {mem} | "
        f"planner GPU / host {mem} | wall s |",
        "| --- | --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |"]
    for t in data["trials"]:
        result = "ok" if t["status"] == "ok" else (
            "refused (extrapolated host memory)" if t["status"] == "refused" else f"failed: {t['reason']}")
        if t.get("comparison"):
            result += " (comparison)"
        steps = ", ".join(f"{x:.2f}" for x in t.get("step_s", [])) or "-"
        tps = f"{t['tokens_per_s']:.0f}" if t.get("tokens_per_s") and t["status"] == "ok" else "-"
        p = t.get("planner") or {}
        host = _mem(t.get("host_peak_bytes"), dry)
        if t.get("reason") == "host memory" and host != "-":
            host = "> " + host  # killed at the limit: it needed more
        planner = f"{_mem(p.get('gpu_bytes'), dry)} / {_mem(p.get('host_bytes'), dry)}" if p.get("host_bytes") else "-"
        lines.append(f"| {t['mode']} | {t['engine']} | {_size(t, unit)} | {result} | {tps} | {steps} | "
                     f"{_mem(t.get('gpu_peak_bytes'), dry)} | {host} | {planner} | "
                     f"{t['wall_s']:.0f} |")
    failures = [t for t in data["trials"] if t["status"] != "ok"]
    if failures or data["notes"]:
        lines += ["", "Notes:"]
        lines += [f"- {t['mode']} {t['engine']} {t['size']}: {str(t.get('detail', ''))[-300:]}" for t in failures]
        lines += [f"- {n}" for n in data["notes"]]
    lines += ["", f"Reproduce: `{data['command']}`", ""]
    return "\n".join(lines)
