"""`zerotrain bench compute [MODEL]`: what this machine's device computes per second, for the step-time model.

    zerotrain bench compute [MODEL] [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--hidden H]
                            [--intermediate I] [--tokens T] [--heads N] [--seq-len S] [--micro-batch B]
                            [--optimizer-elements N] [--iters 10] [--warmup 2] [--threads N] [--json FILE]

Measures (compute_probe.py) a transformer layer's GEMMs forward and backward, causal SDPA forward +
backward, Adam steps on the CPU and on the device, and pinned host <-> device copies, and writes
them as the JSON `zerotrain plan --compute FILE` calibrates its step times with (`JSON_KIND`, version
`JSON_VERSION`; the key names are that contract). MODEL (as `zerotrain plan` takes it) sizes the layer;
flags override it. With MODEL it also times the model's own decoder layer (`layer_tflops`: a one-layer
copy of the model built on the device, its layer called with the arguments the model gives it) and its
final norm + LM head + loss (`head_tflops`), forward + backward at --micro-batch x --seq-len, FLOPs
counted as planning/model_flops.py counts them; an architecture whose layers or head are not found
leaves those keys out. `copy_gbps` and `fresh_copy_gbps`: copies on the device into an existing and
into a newly allocated buffer (MODEL's gradient size), the engine's own gradient-buffer traffic.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

JSON_KIND = "zerotrain-bench-compute"
JSON_VERSION = 1
# Defaults per device: a GPU gets a 7B-class layer; the CPU a small one, so the probe takes seconds.
DEFAULTS = {"cuda": {"hidden": 4096, "intermediate": 11008, "seq_len": 2048, "micro_batch": 2,
                     "optimizer_elements": 16 << 20, "copy_bytes": 1 << 30},
            "cpu": {"hidden": 512, "intermediate": 1376, "seq_len": 512, "micro_batch": 1,
                    "optimizer_elements": 4 << 20, "copy_bytes": 64 << 20}}
HEAD_DIM = 128
"""Without MODEL or --heads: hidden / 128 heads."""
_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _count(text: str) -> int:
    """A positive count, plain or with K/M/G (powers of 1024): 4M = 4194304."""
    number, scale = text.strip(), 1
    if number[-1:].upper() in _SUFFIXES:
        number, scale = number[:-1], _SUFFIXES[number[-1].upper()]
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 4M or 1000000, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `compute` to `zerotrain bench`."""
    p = commands.add_parser(
        "compute", help="matmul, attention, Adam and copy rates of this machine's device (calibrates zerotrain plan)",
        description="Time a transformer layer's GEMMs (forward and both backward GEMMs), causal SDPA, Adam steps "
        "on the CPU and the device, and pinned host<->device copies on this machine's GPU (else its CPU). "
        "--json FILE writes the rates for `zerotrain plan --compute FILE`. See docs/bench.md.")
    add = p.add_argument
    add("model", metavar="MODEL", nargs="?", default=None,
        help="size the layer like this model (as `zerotrain plan` takes MODEL: a Hugging Face directory or "
        "config.json, a train YAML, a shipped model name, an architecture name); flags below override it")
    add("--config-override", action="append", default=[], metavar="KEY=VALUE", dest="config_overrides",
        help="a MODEL config value, e.g. hidden_size=4096; repeatable")
    add("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is visible, else cpu")
    add("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
        help="matmul and attention dtype (default: bf16 on a GPU, fp32 on the CPU)")
    add("--hidden", type=_positive, default=None, metavar="H",
        help="hidden size (default: MODEL's, else 4096 on a GPU, 512 on the CPU)")
    add("--intermediate", type=_positive, default=None, metavar="I",
        help="MLP intermediate size (default: MODEL's, else 11008 on a GPU, 1376 on the CPU)")
    add("--tokens", type=_positive, default=None, metavar="T",
        help="rows of every GEMM (default: --seq-len x --micro-batch: 4096 on a GPU, 512 on the CPU)")
    add("--heads", type=_positive, default=None, metavar="N",
        help=f"attention heads (default: MODEL's, else hidden / {HEAD_DIM})")
    add("--seq-len", type=_positive, default=None, metavar="S",
        help="attention sequence length (default: as zerotrain plan picks for MODEL, else 2048 on a GPU, 512 on "
        "the CPU; never above --tokens)")
    add("--micro-batch", type=_positive, default=None, metavar="B",
        help="sequences per micro-batch (default: --tokens / --seq-len, else 1 with MODEL or --seq-len, "
        "else 2 on a GPU and 1 on the CPU)")
    add("--optimizer-elements", type=_count, default=None, metavar="N",
        help="fp32 elements Adam steps over, e.g. 16M (default: 16M with a GPU, 4M on the CPU)")
    add("--iters", type=_positive, default=10, metavar="N", help="timed repeats; the median counts (default: 10)")
    add("--warmup", type=int, default=2, metavar="N", help="untimed repeats first (default: %(default)s)")
    add("--threads", type=_positive, default=None, metavar="N",
        help="torch.set_num_threads(N) (default: torch's own; the JSON records it)")
    add("--json", default=None, metavar="FILE", help="also write the results to FILE (for zerotrain plan --compute)")
    p.set_defaults(handler=run_compute)


def _model_dims(args: argparse.Namespace, model) -> dict[str, int]:
    """hidden, intermediate, heads, head_dim and seq_len from MODEL's (meta) model's config (ValueError)."""
    from zerotrain.planning import planning_args as pa

    config = model.config

    def value(*names):
        return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)

    hidden = value("hidden_size", "n_embd", "d_model")
    heads = value("num_attention_heads", "n_head")
    if not (hidden and heads):
        raise ValueError(f"{args.model}: its config ({type(config).__name__}) has no hidden size or head count")
    dims = {"hidden": int(hidden), "heads": int(heads), "intermediate": int(value("intermediate_size", "n_inner",
            "ffn_dim") or 4 * hidden), "head_dim": int(value("head_dim") or hidden // heads)}
    dims["seq_len"] = pa.seq_len(args, model)  # --seq-len, a train YAML's, else 2048 within the model's limit
    return dims


def resolve_shapes(args: argparse.Namespace, device_type: str, model_dims: dict[str, int] | None = None):
    """The Shapes the flags, MODEL's dims and the device's defaults give (ValueError on a mismatch)."""
    from zerotrain.bench.compute_probe import Shapes

    defaults, dims = DEFAULTS[device_type], model_dims or {}
    hidden = args.hidden or dims.get("hidden") or defaults["hidden"]
    intermediate = args.intermediate or dims.get("intermediate") or defaults["intermediate"]
    heads = args.heads or dims.get("heads") or max(1, hidden // HEAD_DIM)
    if dims and not (args.hidden or args.heads):
        head_dim = dims["head_dim"]  # the config's own (some models' heads x head_dim is not hidden)
    elif hidden % heads:
        raise ValueError(f"hidden size {hidden} does not split into {heads} heads; pass --heads N that divides it")
    else:
        head_dim = hidden // heads
    seq_len = args.seq_len or dims.get("seq_len") or defaults["seq_len"]
    if args.tokens:
        seq_len = seq_len if args.seq_len else min(seq_len, args.tokens)
        micro = args.micro_batch or max(1, args.tokens // seq_len)
    else:
        micro = args.micro_batch or (1 if (dims or args.seq_len) else defaults["micro_batch"])
    tokens = args.tokens or seq_len * micro
    return Shapes(hidden, intermediate, tokens, heads, head_dim, micro, seq_len)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def measure_model(meta_model, shapes, dtype, device, warmup: int, iters: int, show) -> dict:
    """`layer_tflops` and `head_tflops` of MODEL's own decoder layer and LM head (with its loss), forward +
    backward at (micro-batch, seq-len), counted as planning/model_flops.py counts them (backward twice the
    forward): {} for an architecture whose layers or head are not found."""
    from zerotrain.bench import compute_probe as probe
    from zerotrain.planning.model_flops import model_flops

    try:
        flops = model_flops(meta_model, shapes.seq_len)
    except ValueError:
        return {}
    show("the model's own layer (forward + backward)")
    built = probe.one_layer_model(meta_model, dtype, device)
    if built is None:
        return {}
    model, layer = built
    out = {}
    seconds = probe.measure_layer(model, layer, shapes.batch, shapes.seq_len, device, warmup, iters)
    layer_flops = 3 * (flops.layer_matmul + flops.layer_attention) / flops.layers * shapes.batch
    out["layer_tflops"] = layer_flops / seconds / 1e12
    show("the model's LM head and loss (forward + backward)")
    seconds = probe.measure_head(model, shapes.batch, shapes.seq_len, device, warmup, iters)
    if seconds and flops.head_matmul:
        out["head_tflops"] = 3 * flops.head_matmul * shapes.batch / seconds / 1e12
    del model, layer
    return out


def measure(args: argparse.Namespace, device, dtype_name: str, shapes, status=None,
            meta_model=None) -> tuple[dict, dict]:
    """(the JSON document, console-only notes) of one probe run; with `meta_model` (MODEL) also its own
    layer's and head's rates."""
    import torch

    from zerotrain.bench import compute_probe as probe
    from zerotrain.profiling.device_peaks import peak_tflops_by_name

    def show(text: str) -> None:
        if status is not None:
            status.update(text)

    dtype, on_gpu = probe.DTYPES[dtype_name], device.type == "cuda"
    elements = args.optimizer_elements or DEFAULTS[device.type]["optimizer_elements"]
    rows = probe.measure_matmuls(shapes, dtype, device, args.warmup, args.iters, show)
    show("attention (causal SDPA forward + backward)")
    attention = probe.measure_attention(shapes, dtype, device, args.warmup, args.iters)
    own = measure_model(meta_model, shapes, dtype, device, args.warmup, args.iters, show) if meta_model else {}
    copy_bytes = DEFAULTS[device.type]["copy_bytes"]
    if meta_model is not None:  # the size of the model's gradients in the probe's dtype
        from zerotrain.planning.model_source import count_parameters

        copy_bytes = count_parameters(meta_model)[0] * torch.empty(0, dtype=dtype).element_size()
        # At least 64 MiB: on the CPU a buffer that large comes from the OS (glibc's mmap threshold is at
        # most 32 MiB), as the engine's gradient buffers do.
        copy_bytes = min(max(copy_bytes, DEFAULTS["cpu"]["copy_bytes"]), 4 << 30)
    show(f"copies on the device ({copy_bytes / 2**20:,.0f} MiB)")
    copy, fresh_copy = probe.measure_device_copy(device, copy_bytes, args.warmup, args.iters)
    show(f"Adam on the CPU ({elements:,} elements)")
    cpu_adam, cpu_impl = probe.measure_adam(elements, torch.device("cpu"), args.warmup, args.iters)
    device_adam, device_impl = cpu_adam, cpu_impl
    h2d = d2h = None
    if on_gpu:
        show(f"Adam on {device} ({elements:,} elements)")
        device_adam, device_impl = probe.measure_adam(elements, device, args.warmup, args.iters)
        show("pinned copies (256 MiB)")
        h2d, d2h = probe.measure_copies(device, args.warmup, args.iters)
    name = device_name(device)
    peak = peak_tflops_by_name(name, dtype) if on_gpu else None
    matmul = probe.overall_tflops(rows)
    doc = {"kind": JSON_KIND, "version": JSON_VERSION, "device": name, "device_type": device.type,
           "dtype": dtype_name, "threads": torch.get_num_threads(), "shapes": shapes.as_dict(), "matmul": rows,
           "matmul_tflops": matmul, "attention_tflops": attention, **own, "cpu_adam_elements_per_s": cpu_adam,
           "device_adam_elements_per_s": device_adam, "copy_gbps": copy, "fresh_copy_gbps": fresh_copy,
           "copy_bytes": copy_bytes, "host_to_device_gbps": h2d, "device_to_host_gbps": d2h,
           "peak_tflops": peak, "efficiency": matmul / peak if peak else None,
           "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    notes = {"cpu_adam_impl": cpu_impl, "device_adam_impl": device_impl, "elements": elements,
             "batch": shapes.batch, "seq_len": shapes.seq_len}
    return doc, notes


def _rate(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_results(console: Console, doc: dict, notes: dict) -> None:
    """The GEMM table, then one table of the summary figures."""
    s = doc["shapes"]
    table = Table(title=f"matmul on {escape(doc['device'])} ({doc['dtype']}, {doc['threads']} threads): "
                  f"hidden {s['hidden']}, intermediate {s['intermediate']}, tokens {s['tokens']}",
                  title_justify="left")
    for column in ("GEMM", "m", "n", "k", "time (ms)", "TFLOP/s"):
        table.add_column(column, justify="left" if column == "GEMM" else "right")
    for row in doc["matmul"]:
        table.add_row(row["name"], f"{row['m']:,}", f"{row['n']:,}", f"{row['k']:,}", f"{row['seconds'] * 1e3:.3f}",
                      f"{row['tflops']:.3f}")
    console.print(table)
    summary = Table(title="rates", title_justify="left")
    for column in ("figure", "value", "what"):
        summary.add_column(column, justify="right" if column == "value" else "left")
    attention = (f"causal SDPA fwd+bwd, b={notes['batch']} heads={s['heads']} s={notes['seq_len']} "
                 f"d={s['head_dim']} (full square counted)")
    impls = (f"{notes['cpu_adam_impl']} AdamW as the engine builds it",
             f"{notes['device_adam_impl']} AdamW as the engine builds it")
    lines = [("matmul_tflops", _rate(doc["matmul_tflops"]), "all GEMMs: total FLOPs / total time"),
             ("attention_tflops", _rate(doc["attention_tflops"]), attention),
             *[(key, _rate(doc[key]), what) for key, what in (
                 ("layer_tflops", f"MODEL's own decoder layer fwd+bwd, b={notes['batch']} s={notes['seq_len']} "
                  "(model_flops' count)"),
                 ("head_tflops", "MODEL's final norm + LM head + loss fwd+bwd (model_flops' count)"))
               if key in doc],
             ("cpu_adam_elements_per_s", _rate(doc["cpu_adam_elements_per_s"], 0),
              f"{impls[0]}, {notes['elements']:,} fp32 elements"),
             ("device_adam_elements_per_s", _rate(doc["device_adam_elements_per_s"], 0),
              impls[1] + (" on the GPU" if doc["device_type"] == "cuda" else " (the CPU: same figure)")),
             ("copy_gbps", _rate(doc["copy_gbps"]), f"copy on the device into an existing buffer "
              f"({doc['copy_bytes'] / 2**20:,.0f} MiB; with MODEL its gradients' size), GB/s = 1e9 B copied/s"),
             ("fresh_copy_gbps", _rate(doc["fresh_copy_gbps"]), "the same into a newly allocated buffer each time"),
             ("host_to_device_gbps", _rate(doc["host_to_device_gbps"]), "pinned 256 MiB copy, GB/s = 1e9 B/s"),
             ("device_to_host_gbps", _rate(doc["device_to_host_gbps"]), "pinned 256 MiB copy"),
             ("peak_tflops", _rate(doc["peak_tflops"], 1), "datasheet dense peak for this dtype (known GPUs)"),
             ("efficiency", "-" if doc["efficiency"] is None else f"{doc['efficiency']:.1%}",
              "matmul_tflops / peak_tflops")]
    for line in lines:
        summary.add_row(*line)
    console.print(summary)


def run_compute(args: argparse.Namespace) -> int:
    """`zerotrain bench compute`: 0 when measured, 2 on a bad input, 1 when the device ran out of memory."""
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.config.errors import ConfigError

    import torch

    prefix = "zerotrain bench compute"
    try:
        if args.warmup < 0:
            raise ValueError(f"--warmup needs 0 or more, got {args.warmup}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver, "
                             "or pass --device cpu)")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if args.model is None and args.config_overrides:
            raise ValueError("--config-override needs MODEL")
        meta_model = None
        if args.model is not None:
            from zerotrain.planning import planning_args as pa

            meta_model = pa.load_model(args)
        dims = _model_dims(args, meta_model) if meta_model is not None else None
        shapes = resolve_shapes(args, device.type, dims)
    except (ConfigError, ValueError, OSError) as error:
        print_user_error(prefix, error)
        return USAGE_EXIT_CODE
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    out, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    try:
        with err.status(f"{prefix}: starting") as status:
            doc, notes = measure(args, device, dtype, shapes, status, meta_model)
    except torch.cuda.OutOfMemoryError as error:
        print_user_error(prefix, error, message="out of device memory: lower --tokens, --intermediate or "
                         "--optimizer-elements")
        return 1
    print_results(out, doc, notes)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        err.print(f"wrote {escape(args.json)}")
    return 0
