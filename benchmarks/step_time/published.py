"""The step-time model against published training throughput (issue 27, section 3: "Published, at scale").

    python benchmarks/step_time/published.py --out /tmp/published.md [--efficiency h100=0.45,...] [--no-calibrate]

Each entry of published.json as the planner's inputs (a meta-device model with Llama layers, the
hardware, the rung), `predict_step`, and the prediction in the source's own unit (tokens/s/GPU;
Megatron's TFLOPs, recompute counted; a step time) next to the published figure. Nothing is tuned per
entry: one efficiency per device (hardware_rates' defaults, or --efficiency). Then one efficiency per
device calibrated on the llm-foundry rows only (the multiple of 0.05 with the least median |error|),
the other sources held out. Writes a markdown report to --out and the rows beside it (OUT.rows.json; never over published.json).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as Case

import torch

from zerotrain.planning.hardware_rates import DEVICE_NAMES, named_rates, with_inter_node
from zerotrain.planning.ladder import Rung
from zerotrain.planning.model_flops import model_flops
from zerotrain.planning.rung_memory import Hardware, Workload
from zerotrain.planning.step_time import predict_step

CALIBRATION = "foundry-"  # the calibration set: llm-foundry's sweep; all other sources are held out
GRID = [round(0.05 * k, 2) for k in range(4, 20)]  # efficiencies tried: 0.20 ... 0.95
MISS = 0.20
GPUS = (("H200", "h200"), ("H100-PCIE", "h100-pcie"), ("H100", "h100"), ("A100-40", "a100-40gb"),
        ("A100", "a100-80gb"), ("V100", "v100"), ("L40S", "l40s"))
# The stated fabric as a named link: per-GPU NICs map to the IB names (line rate per GPU), one NIC per node to GbE.
INTER = (("400 Gb/s per GPU", "ib-ndr"), ("HDR", "ib-hdr"), ("1600 Gbps", "ib-hdr"),  # 8 x 200 Gb/s
         ("800 Gbps", "ib-edr"), ("400 Gbps", "400gbe"))  # 800 = 8 x 100 Gb/s per node
ASSUMED_INTER = {"h100": "ib-ndr", "h200": "ib-ndr", "a100-80gb": "ib-hdr", "a100-40gb": "ib-hdr"}
UNITS = {"tokens/s": "tok/s", "tflops": "TF", "step_s": "s"}


def prepare(e: dict) -> Case | str:
    """The entry as the planner's inputs (`rungs`: the one it ran),
    or why the model cannot express it."""
    m, hw, t = e["model"], e["hardware"], e["training"]
    missing = [k for k in ("seq_len", "micro_batch", "global_batch", "activation_checkpointing", "zero_stage")
               if t.get(k) is None]
    if missing:  # e.g. seq_len: the tokens of a step are unknown
        return f"not published: {', '.join(missing)}"
    if "HYBRID_SHARD" in t["framework"] or any(int(n) > 1 for n in re.findall(r"\b[TP]P=(\d+)", t["framework"])):
        return f"not expressible: {t['framework']} (no hybrid sharding, tensor or pipeline parallelism)"
    if (device := next((name for key, name in GPUS if key in hw["gpu"].upper()), None)) is None:
        return f"no device named for {hw['gpu']}"
    gpus, per_node = hw["gpus"], min(hw["gpus_per_node"] or hw["gpus"], hw["gpus"])
    mb, seq = t["micro_batch"], t["seq_len"]
    accumulation, rest = divmod(t["global_batch"], mb * gpus)
    if rest or accumulation < 1:
        return f"global batch {t['global_batch']} is not a multiple of {mb} x {gpus} GPUs"
    assumptions = []
    gelu = m["name"].startswith("MPT") or "GPT" in m["name"]  # 2-matrix GELU MLP, tied embeddings
    if gelu and m["intermediate_size"] != 4 * m["hidden_size"]:
        return "GELU MLP with intermediate != 4 x hidden"
    inter, rates = "1 node", named_rates(device)
    if gpus > per_node:
        stated = hw.get("inter_node") or ""
        inter = next((name for key, name in INTER if key in stated), None)
        assumed = inter is None
        if assumed:
            inter = ASSUMED_INTER[device]
            assumptions.append(f"inter-node link not stated: {inter} assumed")
        rates = with_inter_node(rates, inter, per_node, assumed)
    ckpt = t["activation_checkpointing"]
    if selective := ckpt.startswith("selective"):
        assumptions.append("selective checkpointing: its recompute (elementwise ops) at the GPU's HBM bandwidth, "
                           "the pass count measured on an H100 with eager layers")
    rungs = [Rung(t["zero_stage"], offload_optimizer="cpu" if t["offload"].startswith("cpu optimizer") else "none",
                  gradient_checkpointing="selective" if selective else ckpt == "full")]
    if t["offload"].startswith("unknown"):
        assumptions.append("offload unknown: none assumed (recipe default)")
    config = dict(hidden_size=m["hidden_size"], num_hidden_layers=m["num_hidden_layers"],
                  num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_key_value_heads"],
                  # GELU's 2 x (h x 4h) matmuls = SwiGLU's 3 x (h x 8h/3): same FLOPs and parameters
                  intermediate_size=round(m["intermediate_size"] * 2 / 3) if gelu else m["intermediate_size"],
                  vocab_size=m["vocab_size"], max_position_embeddings=max(seq, 2048),
                  tie_word_embeddings=gelu or m["name"].startswith("Qwen2.5-3B"))  # as Qwen2.5-3B's own config
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config))
    dtype = t["dtype"] if t["dtype"] in ("bf16", "fp16") else "bf16"
    workload = Workload(seq, mb, dtype, "eager" if t.get("flash_attention") is False else "sdpa")
    words = e["measured"]["as_published"].lower()  # the figure the source gives (the others are derived)
    unit = ("tflops" if "tokens" not in words and e["measured"]["tflops_per_gpu"]
            else "step_s" if "step time" in words else "tokens/s")
    meas, n_params = e["measured"], sum(p.numel() for p in model.parameters())
    value = {"tokens/s": meas["tokens_per_s_per_gpu"], "tflops": meas["tflops_per_gpu"],
             "step_s": meas["step_time_s"]}
    role = "calibration" if e["id"].startswith(CALIBRATION) else "held-out"
    return Case(entry=e, model=model, device=device, rates=rates, hardware=Hardware(per_node, gpus // per_node),
                workload=workload, rungs=rungs, accumulation=accumulation, unit=unit, gelu=gelu, inter=inter,
                n_params=n_params, assumptions=assumptions, role=role, published=value[unit])


def source_flops_per_token(case: Case) -> float | None:
    """FLOPs per token as the source counts them (its MFU or TFLOPs), from its notes."""
    m, s = case.entry["model"], case.workload.seq_len
    layers, h = m["num_hidden_layers"], m["hidden_size"]
    if case.entry["id"].startswith("deepspeed-azure"):  # Megatron: 96 B s l h^2 (1 + s/6h + V/16lh), 4 passes
        return 96 * layers * h * h * (1 + s / (6 * h) + m["vocab_size"] / (16 * layers * h))
    if case.entry["id"].startswith(("foundry-", "torchtitan-", "fms-")):  # 6N + 12 L d s, N with embeddings
        return 6 * (m.get("params") or case.n_params) + 12 * layers * h * s
    return None


def efficiency_of(case: Case, efficiencies: dict) -> float:
    """The device's efficiency: the given one, else hardware_rates' default (its rate over its peak)."""
    return efficiencies.get(case.device, case.rates.device.tflops / case.rates.device.peak_tflops)


def predict(case: Case, efficiency: float) -> list:
    """One StepTime per rung, the device's achievable rate set to `efficiency` x its peak."""
    rates = replace(case.rates, device=replace(case.rates.device, tflops=case.rates.device.peak_tflops * efficiency))
    return [predict_step(case.model, rung, case.workload, case.hardware, rates, case.accumulation)
            for rung in case.rungs]


def figure(case: Case, step) -> float:
    """A prediction in the source's unit."""
    if case.unit == "tflops":
        return source_flops_per_token(case) * step.tokens_per_s_per_gpu / 1e12
    return step.step_s if case.unit == "step_s" else step.tokens_per_s_per_gpu


def speed_error(case: Case, value: float) -> float:
    """+: the model predicts a faster step than published (too optimistic), in any unit."""
    return case.published / value - 1 if case.unit == "step_s" else value / case.published - 1


def reasons(case: Case, step, speed: float) -> str:
    """Known differences between the entry and the model that can explain a miss in this direction."""
    e, t = case.entry, case.entry["training"]
    tokens, gpus = case.workload.micro_batch * case.workload.seq_len, e["hardware"]["gpus"]
    flops = model_flops(case.model, case.workload.seq_len)
    attention = flops.layer_attention / flops.forward
    why = [text for cond, text in (
        (speed < 0 and t.get("torch_compile"), "torch.compile used"),
        (speed < 0 and attention > 0.2, f"attention {attention:.0%} of FLOPs, counted full-square (causal does half)"),
        (speed < 0 and step.rung.gradient_checkpointing, "full recompute: checkpointed rows fit a higher eff."),
        (speed > 0 and not step.rung.gradient_checkpointing, "no recompute: such rows fit a lower eff."),
        (speed > 0 and "NOT a standard" in (e["hardware"].get("gpu_note") or ""), "non-standard H100 (HBM2e, 500 W)"),
        (speed > 0 and "warm-up" in e["notes"], "timing includes warm-up"),
        (speed > 0 and gpus >= 512, f"{gpus} GPUs: stragglers, network contention not modelled"),
        (tokens <= 4096 and gpus > 8, f"small per-GPU batch ({tokens} tokens) on {gpus} GPUs"),
        (step.exposed_share > 0.1, f"model: {step.exposed_share:.0%} of the step exposed comm"),
        (step.offload_s > 0, f"CPU Adam rate assumed ({case.rates.cpu_adam_elements_per_s:.0e} el/s/node): "
                             f"{step.offload_s / step.step_s:.0%} of step"),
        (t["dtype"] == "fp16" and t.get("flash_attention") is False, "2022 stack: fp16, no FlashAttention")) if cond]
    return "; ".join(why) or "no known cause"


def fitted(eff: float, step, speed: float) -> float | None:
    """The efficiency that would match the published figure (compute scales with it; the rest held)."""
    rest = step.step_s - step.compute_s
    compute = step.step_s * (1 + speed) - rest
    return eff * step.compute_s / compute if compute > 0 else None


def evaluate(cases: list, efficiencies: dict) -> list:
    rows = []
    for case in cases:
        eff = efficiency_of(case, efficiencies)
        steps = predict(case, eff)
        values = [figure(case, s) for s in steps]
        errors = [v / case.published - 1 for v in values]
        speeds = [speed_error(case, v) for v in values]
        fpt, meas = source_flops_per_token(case), case.entry["measured"]
        peak = case.rates.device.peak_tflops * 1e12
        mfu = [fpt * s.tokens_per_s_per_gpu / peak for s in steps] if fpt and meas["mfu"] else None
        worst = max(range(len(speeds)), key=lambda i: abs(speeds[i]))
        miss = min(abs(x) for x in errors) > MISS
        rows.append({"id": case.entry["id"], "role": case.role, "device": case.device, "efficiency": eff,
                     "unit": case.unit, "published": case.published, "predicted": values, "error": errors,
                     "speed_error": speeds,
                     "fitted_efficiency": [fitted(eff, s, x) for s, x in zip(steps, speeds)],
                     "published_mfu": meas["mfu"], "predicted_mfu_source_formula": mfu,
                     "source_formula_check": fpt * meas["tokens_per_s_per_gpu"] / (
                         peak if case.unit != "tflops" else 1e12) if fpt else None,
                     "notes": reasons(case, steps[worst], speeds[worst]) if miss else "",
                     "inter_node": case.inter, "accumulation": case.accumulation, "params": case.n_params,
                     "assumptions": case.assumptions, "steps": [
                         {k: v for k, v in s.as_dict().items() if k != "bytes_sent_per_rank"} for s in steps]})
    return rows


def calibrate(cases: list, base: dict) -> tuple[dict, dict]:
    """Per device of the calibration rows: the grid efficiency with the least median |error| on them."""
    chosen, table = dict(base), {}
    for device in sorted({c.device for c in cases if c.role == "calibration"}):
        mine = [c for c in cases if c.role == "calibration" and c.device == device]
        medians = {eff: statistics.median(abs(speed_error(c, figure(c, predict(c, eff)[0]))) for c in mine)
                   for eff in GRID}
        chosen[device] = min(medians, key=lambda eff: (medians[eff], eff))
        table[device] = {"rows": [c.entry["id"] for c in mine], "median_abs_error_by_efficiency": medians,
                         "chosen": chosen[device]}
    return chosen, table


def markdown(title: str, cases: list, rows: list) -> list:
    out = [f"### {title}", "", "| id | set | model | GPUs | setup | eff (fit) | published | predicted | error | notes "
           "| source |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, row in zip(cases, rows):
        e, t, unit = case.entry, case.entry["training"], UNITS[row["unit"]]
        ckpt = t["activation_checkpointing"]
        setup = (f"Z{t['zero_stage']}{' +opt cpu' if case.rungs[0].offload_optimizer == 'cpu' else ''}, ckpt {ckpt}, "
                 f"{t['micro_batch']}×{t['seq_len']}, acc {case.accumulation}, "
                 f"{case.inter}{' (assumed)' if any('inter-node' in a for a in case.assumptions) else ''}"
                 f"{', fp16' if t['dtype'] == 'fp16' else ''}{', compile' if t.get('torch_compile') else ''}")
        mfu = lambda x: f" (MFU {x:.1%})" if x is not None else ""  # noqa: E731
        fmt = {"tokens/s": "{:,.0f}", "tflops": "{:,.1f}", "step_s": "{:.2f}"}[row["unit"]].format
        pub = f"{fmt(row['published'])} {unit}{mfu(row['published_mfu'])}"
        pm = row["predicted_mfu_source_formula"] or [None] * len(row["predicted"])
        pred = " / ".join(f"{fmt(v)}{mfu(x)}" for v, x in zip(row["predicted"], pm)) + f" {unit}"
        err = " / ".join(f"{x:+.0%}" for x in row["error"])
        link = e["source"].split()[0]
        role = "calib" if case.role == "calibration" else "**held-out**"
        name = e["model"]["name"].split(" (")[0] + (" †" if case.gelu else "")
        fit = "/".join("offload-bound" if x is None else f"{x:.2f}" for x in row["fitted_efficiency"])
        out.append(f"| {e['id']} | {role} | {name} | {e['hardware']['gpus']} {case.device} | {setup} | "
                   f"{row['efficiency']:.2f} ({fit}) | {pub} | "
                   f"{pred} | {err} | {row['notes']} | [{link.split('/')[4]}]({link}) |")
    return out + ["", *summary(rows), ""]


def summary(rows: list) -> list:
    lines = []
    for role in ("calibration", "held-out"):
        single = [r for r in rows if r["role"] == role]
        if single:
            errs = [abs(r["speed_error"][0]) for r in single]
            signed = statistics.median(r["speed_error"][0] for r in single)
            lines.append(f"- {role}: {len(single)} rows, median |error| {statistics.median(errs):.0%}, "
                         f"max {max(errs):.0%}, within 20%: {sum(x <= MISS for x in errs)}/{len(single)}, "
                         f"median signed speed error {signed:+.0%}")
    return lines


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default=str(Path(__file__).with_name("published.json")))
    parser.add_argument("--out", required=True, help="markdown report; the rows go beside it as .rows.json")
    parser.add_argument("--efficiency", default="", help="per-device overrides, e.g. a100-80gb=0.6,h100=0.45")
    parser.add_argument("--no-calibrate", action="store_true", help="only the table at the given efficiencies")
    args = parser.parse_args(argv)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"$ {command}\n")
    given = {k.strip(): float(v) for k, v in (kv.split("=") for kv in args.efficiency.split(",") if kv.strip())}
    if unknown := set(given) - set(DEVICE_NAMES):
        parser.error(f"--efficiency: unknown device {', '.join(sorted(unknown))}; known: {', '.join(DEVICE_NAMES)}")
    prepared = [(entry["id"], prepare(entry)) for entry in json.loads(Path(args.entries).read_text())]
    cases = [case for _, case in prepared if not isinstance(case, str)]
    skipped = [{"id": name, "reason": case} for name, case in prepared if isinstance(case, str)]
    base = {c.device: efficiency_of(c, given) for c in cases}
    title = f"At --efficiency {args.efficiency}, else defaults" if given else "At hardware_rates' defaults"
    rows = evaluate(cases, base)
    lines = [f"`{command}`", "", *markdown(title, cases, rows)]
    result = {"command": command, "efficiencies": base, "rows": rows, "skipped": skipped}
    if not args.no_calibrate:
        chosen, table = calibrate(cases, base)
        flag = ",".join(f"{d}={x:.2f}" for d, x in sorted(chosen.items()))
        calibrated = evaluate(cases, chosen)
        lines += markdown(f"Calibrated on the llm-foundry rows only (--efficiency {flag}); other rows held out",
                          cases, calibrated)
        lines += ["Calibration (median |error| over the foundry rows of each device, per efficiency):", ""]
        lines += [f"- {d} ({len(t['rows'])} rows): chosen {t['chosen']:.2f}; " + ", ".join(
            f"{x:.2f}: {m:.0%}" for x, m in t["median_abs_error_by_efficiency"].items()) for d, t in table.items()]
        again = f"python {shlex.quote(sys.argv[0])} --efficiency {flag} --no-calibrate --out OUT.md"
        lines += ["", f"Reproduce the calibrated table: `{again}`", ""]
        result.update(calibrated_efficiencies=chosen, calibration=table, calibrated_rows=calibrated)
    lines += ["† MPT / Megatron GPT: 2-matrix GELU MLP (intermediate 4h) built as a Llama layer with intermediate "
              "8h/3 (same matmul FLOPs and parameters), tied embeddings; biases and learned positions left out.",
              "Error: predicted / published - 1 in the source's unit (a step time: + = slower). Notes: known "
              "differences that can explain a miss > 20%.", "",
              "Skipped:", "", *[f"- {s['id']}: {s['reason']}" for s in skipped], ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".rows.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
