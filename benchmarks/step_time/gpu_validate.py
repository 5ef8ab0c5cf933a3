"""The step-time model against zerotrain's measured steps on a GPU (issue 27, section 3; docs/planning.md).

    python benchmarks/step_time/gpu_validate.py [--data benchmarks/step_time/h100-2026-11-27] [--out FILE.md]

DATA holds what one device loan measured (see its README.md for the commands): `compute-mbB.json` from
`zerotrain bench compute benchmarks/gpu/llama-1b.json --micro-batch B --seq-len 2048 --json ...` and
`speed-mbB.json` from `benchmarks/gpu/run.sh speed --micro-batch B ...` (the GPU check's speed part: a world
of one, zerotrain stages 0-3 with checkpointing off and on). Each zerotrain column is predicted with
`predict_step` from the probe of the same micro-batch (the nearest where none was taken, said so), as
`zerotrain plan --compute` would, and set beside the measured median step and its phases. Two predictions:
the probe as the loan measured it, whose `device_adam_elements_per_s` timed torch's fused Adam (the
engine takes foreach on a GPU), and the same with the optimizer at the rate plain torch's foreach AdamW
reached over the same parameters in the same run (the speed file's `plain` column), where it has one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from zerotrain.planning.hardware_rates import named_rates, with_compute_probe
from zerotrain.planning.ladder import Rung
from zerotrain.planning.model_source import load_meta_model
from zerotrain.planning.rung_memory import Hardware, Workload
from zerotrain.planning.step_time import predict_step

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "gpu" / "llama-1b.json"


def _by_micro_batch(data: Path, kind: str) -> dict[int, dict]:
    return {int(p.stem.split("-mb")[1]): json.loads(p.read_text()) for p in sorted(data.glob(f"{kind}-mb*.json"))}


def plain_optimizer_rate(speed: dict) -> float | None:
    """Elements per second of plain torch's AdamW (foreach, fp32) step in this speed run, if it ran."""
    plain = speed["results"].get("plain", {})
    steps = [mode["phase_ms"]["step"] for mode in plain.values() if isinstance(mode, dict) and mode.get("ok")]
    return speed["job"]["parameters"] / (statistics.median(steps) / 1e3) if steps else None


def rows(data: Path) -> list[dict]:
    probes, speeds = _by_micro_batch(data, "compute"), _by_micro_batch(data, "speed")
    model = load_meta_model(str(MODEL))
    foreach_rate = next((r for r in map(plain_optimizer_rate, speeds.values()) if r), None)
    out = []
    for mb, speed in speeds.items():
        probe_mb = min(probes, key=lambda b: abs(b - mb))
        rates = with_compute_probe(named_rates("h100"), data / f"compute-mb{probe_mb}.json")
        rates_foreach = replace(rates, device=replace(rates.device, optimizer_elements_per_s=foreach_rate)) \
            if foreach_rate else None
        workload = Workload(speed["job"]["seq"], mb, speed["job"]["dtype"])
        for engine, modes in speed["results"].items():
            if not engine.startswith("zerotrain-"):
                continue
            stage = int(engine.split("-")[1])
            for mode, result in modes.items():
                if not isinstance(result, dict) or not result.get("ok"):
                    continue
                rung = Rung(stage, "none", "none", mode == "on")
                guess = predict_step(model, rung, workload, Hardware(1), rates)
                fixed = predict_step(model, rung, workload, Hardware(1), rates_foreach) if rates_foreach else None
                phases = result["phase_ms"]
                out.append({
                    "micro_batch": mb, "probe_micro_batch": probe_mb, "stage": stage, "checkpointing": mode == "on",
                    "measured_ms": result["step_ms"], "measured_fwd_bwd_ms": phases["forward"] + phases["backward"],
                    "measured_opt_ms": phases["step"], "gpu_idle_ms": result.get("gpu_idle_ms"),
                    "predicted_ms": guess.step_s * 1e3, "predicted_compute_ms": guess.compute_s * 1e3,
                    "predicted_opt_ms": (guess.optimizer_s + guess.buffers_s) * 1e3,
                    "predicted_foreach_ms": fixed.step_s * 1e3 if fixed else None,
                    "predicted_foreach_opt_ms": (fixed.optimizer_s + fixed.buffers_s) * 1e3 if fixed else None,
                })
    return out


def _pct(predicted: float | None, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}" if predicted else "-"


def markdown(table: list[dict], data: Path, foreach_rate: float | None) -> str:
    lines = ["| micro-batch | stage | ckpt | measured step ms (fwd+bwd / opt) | GPU idle ms | predicted, probe as "
             "measured (compute / opt) | error | predicted, foreach optimizer rate (opt) | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        mb = f"{r['micro_batch']}" + ("" if r["probe_micro_batch"] == r["micro_batch"] else
                                      f" (probe at {r['probe_micro_batch']})")
        fixed = f"{r['predicted_foreach_ms']:.1f} ({r['predicted_foreach_opt_ms']:.1f})" \
            if r["predicted_foreach_ms"] else "-"
        lines.append(
            f"| {mb} | {r['stage']} | {'on' if r['checkpointing'] else 'off'} | {r['measured_ms']:.1f} "
            f"({r['measured_fwd_bwd_ms']:.1f} / {r['measured_opt_ms']:.1f}) | {r['gpu_idle_ms']:.1f} | "
            f"{r['predicted_ms']:.1f} ({r['predicted_compute_ms']:.1f} / {r['predicted_opt_ms']:.1f}) | "
            f"{_pct(r['predicted_ms'], r['measured_ms'])} | {fixed} | {_pct(r['predicted_foreach_ms'], r['measured_ms'])} |")
    errors = [abs(r["predicted_foreach_ms"] / r["measured_ms"] - 1) for r in table if r["predicted_foreach_ms"]]
    compute = [abs(r["predicted_compute_ms"] / r["measured_fwd_bwd_ms"] - 1) for r in table]
    lines += ["", f"- rows: {len(table)}; forward + backward against the compute prediction: median |error| "
              f"{statistics.median(compute):.0%}, worst {max(compute):.0%}"]
    if errors:
        lines.append(f"- whole step with the foreach optimizer rate ({foreach_rate / 1e9:.1f}e9 elements/s, plain "
                     f"torch's AdamW in the same run): median |error| {statistics.median(errors):.0%}, worst "
                     f"{max(errors):.0%}, within 15%: {sum(e <= 0.15 for e in errors)}/{len(errors)}")
    lines.append(f"- reproduce: `python benchmarks/step_time/gpu_validate.py --data {data}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(HERE / "h100-2026-11-27"))
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    data = Path(args.data)
    table = rows(data)
    if not table:
        print(f"no speed-mb*.json with zerotrain columns in {data}", file=sys.stderr)
        return 2
    foreach = next((r for r in map(plain_optimizer_rate, _by_micro_batch(data, "speed").values()) if r), None)
    try:
        shown = data.resolve().relative_to(Path.cwd())
    except ValueError:
        shown = data
    text = markdown(table, shown, foreach)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
