"""longseq.json and longseq.md of the long-sequence part: longest lengths, every trial, the two targets.

Targets (issue 37, section 5), each "met", "missed" or "not shown" (with why):
- ALST's longest >= 8x plain's, per shape. Shown only where plain's longest is its memory
  boundary; ALST's longest is a lower bound when time or the cap stopped it, so a lower bound
  already >= 8x meets the target, and a missed target needs ALST's memory boundary too.
- the planner's predicted maximum within 10% of the measured one, per shape and mode: only where the
  measured one is a memory boundary (the bisection resolves it to 1/16, finer than the 10%).
The markdown is written to be pasted into docs/benchmarks.md as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longseq_search import LengthSearch
from longseq_shapes import MODE_TITLES, switches

GIB = 2**30
RATIO_TARGET = 8.0
PREDICTION_TOLERANCE = 0.10


def summarize(search: LengthSearch, plan: dict) -> dict[str, Any]:
    longest = search.longest_ok()
    best = next((t for t in search.trials if t["seq"] == longest), None)
    return {
        "rung": plan["rung"]["name"], "predicted_max": plan["predicted_max"], "planner_per_rung": plan["per_rung"],
        "longest": longest, "bounded_by_memory": search.bounded_by_memory(),
        "first_out_of_memory": search.shortest_memory_failure(), "stopped": search.done,
        "median_step_s_at_longest": best.get("median_step_s") if best else None,
        "gpu_peak_bytes_at_longest": best.get("gpu_peak_bytes") if best else None,
        "trials": search.trials, "not_tried": search.not_tried,
    }


def ratio_target(plain: dict | None, alst: dict | None) -> dict[str, Any]:
    """ALST's longest against 8x plain's, for one shape (see the module docstring)."""
    if not plain or not alst or not plain["longest"] or not alst["longest"]:
        return {"verdict": "not shown", "detail": "a mode trained no length (or did not run)"}
    ratio = alst["longest"] / plain["longest"]
    row = {"ratio": round(ratio, 2)}
    if not plain["bounded_by_memory"]:
        return {**row, "verdict": "not shown", "detail": f"plain's longest is not its memory limit ({plain['stopped']})"}
    if ratio >= RATIO_TARGET:
        return {**row, "verdict": "met"}
    if alst["bounded_by_memory"]:
        return {**row, "verdict": "missed"}
    return {**row, "verdict": "not shown", "detail": f"ALST stopped before its memory limit ({alst['stopped']})"}


def prediction_target(found: dict) -> dict[str, Any]:
    """The planner's predicted maximum within 10% of the measured one (only at a measured memory boundary)."""
    if not found["bounded_by_memory"]:
        return {"verdict": "not shown", "detail": f"no memory limit measured ({found['stopped']})"}
    error = found["predicted_max"] / found["longest"] - 1
    return {"error": round(error, 3), "verdict": "met" if abs(error) <= PREDICTION_TOLERANCE else "missed"}


def build(args, facts: dict, limits, plans: dict, searches: list[LengthSearch], elapsed: float,
          command: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for s in searches:
        results.setdefault(s.shape, {})[s.mode] = summarize(s, plans[s.shape][s.mode])
    targets = []
    for shape, by_mode in results.items():
        targets.append({"shape": shape, "target": f"ALST >= {RATIO_TARGET:g}x plain's longest",
                        **ratio_target(by_mode.get("plain"), by_mode.get("alst"))})
        for mode, found in by_mode.items():
            targets.append({"shape": shape, "target": f"{mode}: predicted within {PREDICTION_TOLERANCE:.0%}",
                            **prediction_target(found)})
    return {
        "dry": args.dry, "device": facts["device"], "versions": facts.get("versions"), "commit": facts.get("commit"),
        "host_mem_total_bytes": facts["host_mem_total_bytes"], "gpu_total_bytes": facts.get("gpu_total_bytes"),
        "trial_host_limit_bytes": limits.host_limit_bytes, "budget_s": args.budget_s, "elapsed_s": round(elapsed, 1),
        "steps": args.steps, "command": command,
        "modes": {m: {"title": MODE_TITLES[m], "switches": switches(m, args.dry)} for m in args.modes},
        "shapes": {s.name: s.as_dict() for s in args.shapes}, "results": results, "targets": targets,
    }


def markdown(report: dict[str, Any]) -> str:
    gib = lambda b: f"{b / GIB:.1f}" if b else "-"  # noqa: E731
    n = lambda x: f"{x:,}" if x else "-"  # noqa: E731
    lines = [f"### Longest sequence on one GPU: {report['device']}", "",
             f"`{report['command']}` ({report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget; "
             f"{report['steps']} steps a length, micro-batch 1, bf16, random weights).", ""]
    lines += [f"- **{m}**: {d['title']}" for m, d in report["modes"].items()] + [""]
    lines += ["| shape | mode | ZeRO-3 rung (planner's) | predicted longest | measured longest | limit | "
              "step s there | GPU peak GiB there |", "|---|---|---|---:|---:|---|---:|---:|"]
    for shape, by_mode in report["results"].items():
        for mode, f in by_mode.items():
            limit = (f"memory (OOM at {n(f['first_out_of_memory'])})" if f["bounded_by_memory"] else f["stopped"])
            step = f"{f['median_step_s_at_longest']:.2f}" if f["median_step_s_at_longest"] else "-"
            lines.append(f"| {shape} | {mode} | {f['rung']} | {n(f['predicted_max'])} | {n(f['longest'])} | {limit} | "
                         f"{step} | {gib(f['gpu_peak_bytes_at_longest'])} |")
    lines += ["", "| target | shape | result | verdict |", "|---|---|---|---|"]
    for t in report["targets"]:
        got = f"{t['ratio']}x" if "ratio" in t else (f"{t['error']:+.1%}" if "error" in t else "-")
        why = f" ({t['detail']})" if t.get("detail") else ""
        lines.append(f"| {t['target']} | {t['shape']} | {got} | **{t['verdict']}**{why} |")
    lines += ["", "Every length tried:", "", "| shape | mode | length | result | median step s | tokens/s | "
              "GPU peak GiB | host peak GiB |", "|---|---|---:|---|---:|---:|---:|---:|"]
    for shape, by_mode in report["results"].items():
        for mode, f in by_mode.items():
            for t in f["trials"]:
                res = "ok" if t["status"] == "ok" else f"failed: {t['reason']}"
                step = f"{t['median_step_s']:.2f}" if t.get("median_step_s") else "-"
                tps = f"{t['tokens_per_s']:,.0f}" if t.get("tokens_per_s") else "-"
                lines.append(f"| {shape} | {mode} | {t['seq']:,} | {res} | {step} | {tps} | {gib(t.get('gpu_peak_bytes'))} "
                             f"| {t['host_peak_bytes'] / GIB:.2f} |")
            for skip in f["not_tried"]:
                guess = f"predicted {skip['predicted_wall_s']:.0f} s" if skip["predicted_wall_s"] else "no time"
                lines.append(f"| {shape} | {mode} | {skip['seq']:,} | not tried: {guess}, "
                             f"{skip['seconds_left']:.0f} s left | - | - | - | - |")
    return "\n".join(lines) + "\n"


def write_outputs(args, facts: dict, limits, plans: dict, searches: list[LengthSearch], elapsed: float,
                  command: str) -> None:
    report = build(args, facts, limits, plans, searches, elapsed, command)
    out = Path(args.out_dir)
    (out / "longseq.json").write_text(json.dumps(report, indent=1))
    (out / "longseq.md").write_text(markdown(report))
