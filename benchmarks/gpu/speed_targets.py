"""The speed check's targets (issue 35), each `met` / `NOT met` / `n/a: why`, from the rows that ran.

A target is listed only when all its columns were selected; a column that failed makes it n/a
with the reason. Ratios are "at least" unless the target says "at most" (GPU idle, step-time ratio).
"""

from __future__ import annotations

TARGET_PLAIN_RATIO = 0.95
TARGET_MFU = 0.45
# Compiled, checkpointing off, the run's micro-batch: MFU per stage; tokens/s against the compiled peers.
TARGET_COMPILED_MFU = {0: 0.45, 3: 0.43}
TARGET_OVER_FSDP2 = 1.0
TARGET_OVER_DEEPSPEED_COMPILED = 1.3
# Micro-batch 2, stage 3: the GPU idle at most this share of the step, the step at most this times stage 0's.
TARGET_MB2_IDLE = 0.10
TARGET_MB2_STAGE3_OVER_0 = 1.05


def targets(rows: dict[str, dict[str, dict]], modes: list[str], peak_note: str) -> list[dict]:
    """The issue's targets for the columns and modes that ran (rows: {column: {mode: derived row}})."""
    out = []

    def get(engine: str, mode: str) -> dict | None:
        return rows.get(engine, {}).get(mode)

    def add(label: str, value, limit: float, measured: str, missing: list[tuple[str, dict]],
            at_most: bool = False) -> None:
        if value is None:
            why = "; ".join(f"{n}: {r.get('reason', '?')[:100]}" for n, r in missing if not r.get("ok")) or peak_note
            verdict = f"n/a: {why}"
        else:
            verdict = "met" if (value <= limit if at_most else value >= limit) else "NOT met"
        out.append({"target": label, "value": value, "limit": limit, "measured": measured, "verdict": verdict})

    def ratio(a: str, b: str, mode: str, limit: float, label: str) -> None:
        """tokens/s of column a over column b, when both were selected."""
        x, y = get(a, mode), get(b, mode)
        if x is None or y is None:
            return
        ok = x.get("ok") and y.get("ok")
        add(label, x["tokens_per_s"] / y["tokens_per_s"] if ok else None, limit,
            f"{x['tokens_per_s']:,.0f} vs {y['tokens_per_s']:,.0f} tokens/s" if ok else "-", [(a, x), (b, y)])

    def mfu(column: str, limit: float) -> None:
        z = get(column, "off")
        if z is not None:
            value = z.get("mfu") if z.get("ok") else None
            add(f"{column} MFU >= {limit:.0%} (checkpointing off)", value, limit,
                f"{value:.1%}" if value is not None else "-", [(column, z)])

    for mode in modes:
        ratio("zerotrain-0", "plain", mode, TARGET_PLAIN_RATIO,
              f"zerotrain-0 tokens/s >= {TARGET_PLAIN_RATIO}x plain torch (checkpointing {mode})")
    mfu("zerotrain-0", TARGET_MFU)
    for stage in range(4):
        for mode in modes:
            ratio(f"zerotrain-{stage}", f"deepspeed-{stage}", mode, 1.0,
                  f"zerotrain-{stage} tokens/s >= DeepSpeed-{stage} (checkpointing {mode})")
    for stage, limit in TARGET_COMPILED_MFU.items():
        mfu(f"zerotrain-{stage}-compile", limit)
        ratio(f"zerotrain-{stage}-compile", f"deepspeed-{stage}-compile", "off", TARGET_OVER_DEEPSPEED_COMPILED,
              f"zerotrain-{stage}-compile tokens/s >= {TARGET_OVER_DEEPSPEED_COMPILED}x DeepSpeed-{stage} + "
              "engine.compile() (checkpointing off)")
    ratio("zerotrain-3-compile", "fsdp2-compile", "off", TARGET_OVER_FSDP2,
          "zerotrain-3-compile tokens/s >= FSDP2 + per-block compile (checkpointing off)")
    for tag in ("-compile-mb2", "-mb2"):
        z3, z0 = get(f"zerotrain-3{tag}", "off"), get(f"zerotrain-0{tag}", "off")
        if z3 is not None:
            idle = z3.get("gpu_idle_share") if z3.get("ok") else None
            add(f"zerotrain-3{tag} GPU idle <= {TARGET_MB2_IDLE:.0%} of the step (checkpointing off)", idle,
                TARGET_MB2_IDLE, f"{z3['gpu_idle_ms']:.1f} of {z3['profiled_step_ms']:.1f} ms" if idle is not None
                else "-", [(f"zerotrain-3{tag}", z3)], at_most=True)
        if z3 is not None and z0 is not None:
            ok = z3.get("ok") and z0.get("ok")
            add(f"zerotrain-3{tag} step <= {TARGET_MB2_STAGE3_OVER_0}x zerotrain-0{tag}'s (checkpointing off)",
                z3["step_ms"] / z0["step_ms"] if ok else None, TARGET_MB2_STAGE3_OVER_0,
                f"{z3['step_ms']:.1f} vs {z0['step_ms']:.1f} ms" if ok else "-",
                [(f"zerotrain-3{tag}", z3), (f"zerotrain-0{tag}", z0)], at_most=True)
    return out
