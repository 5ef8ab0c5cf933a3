"""Turns per-engine results into ratios, target verdicts, a rich table and a markdown table."""

from __future__ import annotations

MIB = 1024 * 1024


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_ratios(results: dict[str, dict]) -> None:
    """Adds step-time and peak-memory ratios against DDP and against DeepSpeed's same stage.

    "Same stage" keeps the suffix: zerotrain-2-offload is set against deepspeed-2-offload.
    """
    ddp = results.get("ddp", {})
    for name, r in results.items():
        if not r.get("ok"):
            continue
        family, _, stage = name.partition("-")
        ds = results.get(f"deepspeed-{stage}", {}) if family == "zerotrain" else {}
        r["vs_ddp"] = {"time": ratio(r["step_ms"], ddp.get("step_ms")), "mem": ratio(r["peak_mib"], ddp.get("peak_mib"))}
        r["vs_deepspeed"] = {"time": ratio(r["step_ms"], ds.get("step_ms")), "mem": ratio(r["peak_mib"], ds.get("peak_mib"))}


STAGES_0_2 = "stages 0-2"
STAGE3_OFFLOAD = "stage 3 and CPU offload"


def targets(results: dict[str, dict]) -> list[dict]:
    """The project's stated targets, each marked met / NOT met / n/a from the measured numbers.

    A target is listed only when both of its engines were part of the run (so a subset run
    prints only its own targets); one whose engine was run but failed says n/a and why.
    Each target carries a `group`, the markdown prints one table per group.
    """
    out = []

    def check(group: str, label: str, a: str, b: str, key: str, limit: float) -> None:
        if a not in results or b not in results:
            return
        ra, rb = results[a], results[b]
        value = ratio(ra.get(key), rb.get(key)) if ra.get("ok") and rb.get("ok") else None
        verdict = "met" if value is not None and value <= limit else "NOT met"
        if value is None:
            failed = [f"{n} skipped ({r.get('reason', '?')[:80]})" for n, r in ((a, ra), (b, rb)) if not r.get("ok")]
            verdict = "n/a: " + "; ".join(failed) if failed else "n/a"
        # With --repeats, the spread of the ratio over pairs of runs: a verdict whose
        # limit lies inside it could flip on a rerun.
        runs_key = {"step_ms": "runs_step_ms", "peak_mib": "runs_peak_mib"}[key]
        spread = None
        if value is not None and len(ra.get(runs_key, [])) > 1 and len(rb.get(runs_key, [])) > 1:
            spread = (min(ra[runs_key]) / max(rb[runs_key]), max(ra[runs_key]) / min(rb[runs_key]))
            if spread[0] <= limit < spread[1]:
                verdict += " (within run-to-run noise)"
        out.append({"group": group, "target": label, "ratio": value, "limit": limit, "verdict": verdict,
                    "spread": spread, "measured": f"{_num(ra.get(key))} vs {_num(rb.get(key))}"})

    g = STAGES_0_2
    check(g, "zerotrain-0 step time within 5% of DDP", "zerotrain-0", "ddp", "step_ms", 1.05)
    check(g, "zerotrain-1 step time no slower than DDP", "zerotrain-1", "ddp", "step_ms", 1.0)
    for s in (0, 1, 2):
        check(g, f"zerotrain-{s} step time no slower than DeepSpeed-{s}", f"zerotrain-{s}", f"deepspeed-{s}",
              "step_ms", 1.0)
    for s in (0, 1, 2):
        check(g, f"zerotrain-{s} peak memory/rank no higher than DeepSpeed-{s}", f"zerotrain-{s}", f"deepspeed-{s}",
              "peak_mib", 1.0)

    g = STAGE3_OFFLOAD
    check(g, "zerotrain-3 step time within 1.15x zerotrain-2's", "zerotrain-3", "zerotrain-2", "step_ms", 1.15)
    for base, label in (("fsdp2", "FSDP2"), ("deepspeed-3", "DeepSpeed-3")):
        check(g, f"zerotrain-3 step time no slower than {label}", "zerotrain-3", base, "step_ms", 1.0)
    for s in (2, 3):
        check(g, f"zerotrain-{s}-offload step time no slower than DeepSpeed-{s}-offload",
              f"zerotrain-{s}-offload", f"deepspeed-{s}-offload", "step_ms", 1.0)
    for base, label in (("fsdp2", "FSDP2"), ("deepspeed-3", "DeepSpeed-3")):
        check(g, f"zerotrain-3 peak memory/rank no higher than {label}", "zerotrain-3", base, "peak_mib", 1.0)
    for s in (2, 3):
        check(g, f"zerotrain-{s}-offload peak memory/rank no higher than DeepSpeed-{s}-offload",
              f"zerotrain-{s}-offload", f"deepspeed-{s}-offload", "peak_mib", 1.0)
    # Reference, not like-for-like: DeepSpeed's default offload optimizer (C++ CPU Adam) vs our torch AdamW.
    for s in (2, 3):
        for key, what in (("step_ms", "step time no slower"), ("peak_mib", "peak memory/rank no higher")):
            check(g, f"zerotrain-{s}-offload {what} than DeepSpeed-{s}-offload with DeepSpeedCPUAdam (reference)",
                  f"zerotrain-{s}-offload", f"deepspeed-{s}-offload-cpuadam", key, 1.0)
    return out


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _spread(g: dict) -> str:
    return "-" if not g.get("spread") else f"{g['spread'][0]:.2f}-{g['spread'][1]:.2f}x"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def rows(results: dict[str, dict]) -> list[list[str]]:
    out = []
    for name, r in results.items():
        if not r.get("ok"):
            out.append([name, f"skipped: {r.get('reason', '?')}"] + [""] * (len(HEADERS) - 2))
            continue
        out.append([
            name,
            f"{r['step_ms']:.1f} ({r['step_ms_p25']:.0f}-{r['step_ms_p75']:.0f})",
            f"{r['tokens_per_s']:.0f}",
            f"{r['peak_mib']:.1f}",
            f"{r['loss_first']:.3f} -> {r['loss_final']:.3f}",
            _x(r["vs_ddp"]["time"]), _x(r["vs_ddp"]["mem"]),
            _x(r["vs_deepspeed"]["time"]), _x(r["vs_deepspeed"]["mem"]),
        ])
    return out


def detail_rows(results: dict[str, dict]) -> list[list[str]]:
    out = []
    for name, r in results.items():
        if not r.get("ok"):
            continue
        p, m = r["phase_ms"], r["phase_peak_mib"]
        state = r.get("engine_breakdown")
        out.append([
            name,
            f"{p['forward']:.0f} / {p['backward']:.0f} / {p['step']:.0f}",
            f"{m['forward']:.0f} / {m['backward']:.0f} / {m['step']:.0f}",
            f"{r['raw_peak_mib']:.0f}", f"{r['after_build_mib']:.0f}", f"{r['build_peak_mib']:.0f}",
            f"{sum(v for k, v in state.items() if k != 'optimizer_scalars') / MIB:.1f}" if state else "-",
            f"{r.get('foreign_load_cores', 0):.2f}",
        ])
    return out


HEADERS = ["engine", "step ms median (p25-p75)", "tokens/s", "peak mem/rank MiB", "loss first -> final",
           "time / DDP", "mem / DDP", "time / DS same stage", "mem / DS same stage"]
DETAIL_HEADERS = ["engine", "fwd / bwd / step ms (medians)", "peak MiB in fwd / bwd / step",
                  "raw peak MiB (untrimmed)", "MiB after build", "build peak MiB", "engine.memory_breakdown() MiB", "other procs' load (cores)"]


def print_rich(results: dict[str, dict], tgts: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    t = Table(title=f"{meta['job']}  |  {meta['machine']}", title_justify="left")
    for h in HEADERS:
        t.add_column(h, justify="left" if h == "engine" else "right")
    for row in rows(results):
        t.add_row(*row)
    console.print(t)
    console.print(f"[dim]memory: {meta['memory_method']}[/dim]")
    dt = Table(title="where the time and memory go", title_justify="left")
    for h in DETAIL_HEADERS:
        dt.add_column(h, justify="left" if h == "engine" else "right")
    for row in detail_rows(results):
        dt.add_row(*row)
    console.print(dt)
    for group in dict.fromkeys(g["group"] for g in tgts):
        tt = Table(title=f"targets, {group}", title_justify="left")
        for h in ("target", "measured", "ratio", "ratio range over repeats", "verdict"):
            tt.add_column(h)
        for g in (g for g in tgts if g["group"] == group):
            v = g["verdict"]
            style = "green" if v == "met" else "dim" if v.startswith("n/a") else "bold red" if v == "NOT met" \
                else "yellow"
            tt.add_row(g["target"], g["measured"], _x(g["ratio"]), _spread(g), f"[{style}]{v}[/{style}]")
        console.print(tt)
    for note in meta.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")


def markdown(results: dict[str, dict], tgts: list[dict], meta: dict) -> str:
    lines = [f"Job: {meta['job']}", "", f"Machine: {meta['machine']}", "",
             f"Command: `{meta['command']}`", "", f"Date: {meta['date']}", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    lines += ["", f"Peak memory: {meta['memory_method']}", "", "| " + " | ".join(DETAIL_HEADERS) + " |",
              "|" + "---|" * len(DETAIL_HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in detail_rows(results)]
    groups = list(dict.fromkeys(g["group"] for g in tgts))
    for group in groups:
        if len(groups) > 1:
            lines += ["", f"Targets, {group}:"]
        lines += ["", "| target | measured | ratio | ratio range over repeats | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {g['target']} | {g['measured']} | {_x(g['ratio'])} | {_spread(g)} | **{g['verdict']}** |"
                  for g in tgts if g["group"] == group]
    if meta.get("notes"):
        lines += [""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"
