"""How fast the hardware is: the inputs of the step-time model, measured or named.

Every rate comes from one of two places, and `Rates.sources` says which:

* a probe's JSON: `zerotrain bench compute --json` (matmul, attention and optimizer rates, the model's
  own layer and head, copies on the device and host<->device) and `zerotrain bench comm --json`
  (collective times over sizes, fitted here to a latency and a bus bandwidth per collective, and kept
  to interpolate between on as many ranks);
* a named default: a device (`h100`, `a100-80gb`, ...: datasheet peak x one efficiency per
  device) and links (`nvlink4`, `pcie5`, `ib-ndr`, `400gbe`, ...: line rate x the fraction
  NCCL reaches on it).

Bandwidths are nccl-tests' bus bandwidth (GB/s, 1e9 bytes): a ring collective of S bytes on n
ranks takes `steps * latency + S * factor / busbw`, factor 2(n-1)/n for all-reduce and (n-1)/n
for all-gather and reduce-scatter (bench/bandwidth.py has the same conventions).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator's compute, as the model uses it."""

    name: str
    peak_tflops: float | None
    """Dense 16-bit peak from the datasheet (the MFU denominator); None on a CPU."""
    tflops: float
    """Achievable rate on a transformer's forward and backward (counted FLOPs / time)."""
    optimizer_elements_per_s: float
    """Optimizer (Adam) step rate on the device, fp32 master elements per second."""
    host_link_gbps: float = 25.0
    """Host<->device copy bandwidth (pinned), GB/s: what offload's copies move at."""
    memory_gb: float | None = None
    memory_bandwidth_gbps: float | None = None
    """HBM bandwidth from the datasheet, GB/s: what the memory-bound ops selective checkpointing
    recomputes run at (None: not known, they are not counted)."""


@dataclass(frozen=True)
class Link:
    """One level of the network as a ring collective sees it."""

    name: str
    busbw_gbps: float
    """Achievable bus bandwidth, GB/s (intra-node: per GPU; inter-node: the node's NICs together)."""
    latency_s: float
    """Cost of one ring step (a hop): kernel launch, NIC and switch latency."""


@dataclass(frozen=True)
class CollectiveFit:
    """A collective fitted from `bench comm`: t(S) = fixed_s + S * factor / busbw, and the measurements."""

    fixed_s: float
    busbw_gbps: float
    ranks: int
    measured: tuple[tuple[float, float], ...] = ()
    """(S bytes, seconds) as `bench comm` timed them, by size: on `ranks` ranks, a size between two of them
    is interpolated between those two rather than read off the line (see `measured_s`)."""

    def measured_s(self, nbytes: float) -> float | None:
        """Seconds of a collective of S = `nbytes` on `ranks` ranks, interpolated between the two measured
        sizes around it (linearly in S); None outside them. The line above is one latency and one
        bandwidth for all sizes; on CPUs the bandwidth falls as buffers outgrow the caches (Gloo moved
        16 MiB at twice the bus bandwidth of 64 MiB on a 2-core machine), so a fitted line misses both ends."""
        points = self.measured
        if len(points) < 2 or not points[0][0] <= nbytes <= points[-1][0]:
            return None
        for (s0, t0), (s1, t1) in zip(points, points[1:]):
            if s0 <= nbytes <= s1:
                return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0) if s1 > s0 else t0
        return None


# Efficiency: the achievable fraction of the datasheet peak over a whole forward and backward
# (matmuls, attention, norms, activations), one number per device, never per model. H100 and A100:
# calibrated on llm-foundry's published MPT runs only (the multiple of 0.05 with the least median
# error) and checked on torchtitan's, IBM's, DeepSpeed's and TinyLlama's, held out
# (benchmarks/step_time/published.py; docs/planning.md). The others have no published runs in that
# set: H200 as H100 (same chip, faster memory), V100 and L40S a guess.
# Optimizer rate: AdamW's foreach step over fp32 masters, the kernel the engine takes on a GPU, measured
# on an H100 SXM on 2026-11-27 as plain torch's optimizer phase over 1.1B parameters (27e9 elements/s;
# the engine's own step took 43 ms, 1-3% from the prediction: benchmarks/step_time/gpu_validate.py). The
# other GPUs are scaled from it by memory bandwidth, as the step is memory-bound.
_DEVICES = {
    "h100": Device("NVIDIA H100 SXM", 989.0, 989.0 * 0.40, 27e9, 50.0, 80, 3350.0),
    "h100-pcie": Device("NVIDIA H100 PCIe", 756.0, 756.0 * 0.40, 16e9, 50.0, 80, 2000.0),
    "h200": Device("NVIDIA H200", 989.0, 989.0 * 0.42, 39e9, 50.0, 141, 4800.0),
    "a100-80gb": Device("NVIDIA A100 80GB SXM", 312.0, 312.0 * 0.65, 16e9, 25.0, 80, 2039.0),
    "a100-40gb": Device("NVIDIA A100 40GB SXM", 312.0, 312.0 * 0.65, 12.5e9, 25.0, 40, 1555.0),
    "v100": Device("NVIDIA V100 32GB SXM2", 125.0, 125.0 * 0.45, 7.3e9, 12.0, 32, 900.0),
    "l40s": Device("NVIDIA L40S", 362.0, 362.0 * 0.45, 7e9, 25.0, 48, 864.0),
}
# Intra-node: bus bandwidth NCCL reaches for large all-reduces between the GPUs of one node.
_INTRA = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 360.0, 3e-6),
    "nvlink3": Link("NVLink 3 (A100 SXM)", 230.0, 3e-6),
    "nvlink2": Link("NVLink 2 (V100 SXM2)", 130.0, 4e-6),
    "pcie5": Link("PCIe 5 x16", 40.0, 6e-6),
    "pcie4": Link("PCIe 4 x16", 20.0, 6e-6),
    # CPU ranks of one machine under Gloo (bench/bandwidth.py: TCP moves ~1 GB/s at best).
    "gloo-loopback": Link("Gloo over loopback TCP", 1.0, 30e-6),
}
# Inter-node: (line rate per NIC in Gbit/s, NICs per node: None = one per GPU, fraction NCCL reaches).
_INTER = {
    "ib-ndr": (400, None, 0.90, "InfiniBand NDR, one 400 Gb/s NIC per GPU"),
    "ib-hdr": (200, None, 0.90, "InfiniBand HDR, one 200 Gb/s NIC per GPU"),
    "ib-edr": (100, None, 0.90, "InfiniBand EDR, one 100 Gb/s NIC per GPU"),
    "400gbe": (400, 1, 0.80, "one 400 Gb Ethernet NIC per node"),
    "200gbe": (200, 1, 0.80, "one 200 Gb Ethernet NIC per node"),
    "100gbe": (100, 1, 0.80, "one 100 Gb Ethernet NIC per node"),
    "25gbe": (25, 1, 0.80, "one 25 Gb Ethernet NIC per node"),
}
_INTER_LATENCY_S = 8e-6
# A NVLink-less device's default intra-node link, and each GPU's usual one.
_DEFAULT_INTRA = {"h100": "nvlink4", "h200": "nvlink4", "h100-pcie": "pcie5", "a100-80gb": "nvlink3",
                  "a100-40gb": "nvlink3", "v100": "nvlink2", "l40s": "pcie4"}
CPU_ADAM_ELEMENTS_PER_S = 1.0e9
"""A node's CPU Adam rate when no probe gave one (torch's fused CPU Adam on a few dozen cores)."""
NVME_GBPS = 3.0
"""Read and write bandwidth of a node's NVMe when none is measured."""

DEVICE_NAMES = tuple(_DEVICES)
INTRA_NAMES = tuple(_INTRA)
INTER_NAMES = tuple(_INTER)


@dataclass(frozen=True)
class Rates:
    """Everything the step-time model needs to know about speed, and where each figure came from."""

    device: Device
    intra: Link
    inter: Link | None
    """None: one node only, or nothing said (then inter-node rungs are refused by `with_nodes`)."""
    cpu_adam_elements_per_s: float = CPU_ADAM_ELEMENTS_PER_S
    """A node's CPU optimizer rate (shared by its processes)."""
    nvme_gbps: float = NVME_GBPS
    attention_tflops: float | None = None
    """Counted attention FLOPs (full square, as the flops profiler counts) per second; None: `device.tflops`."""
    layer_tflops: float | None = None
    """A whole decoder layer's forward + backward (matmuls, attention, norms, activations) as measured by
    bench compute on the model's own layer: replaces the matmul and attention rates for the layers."""
    head_tflops: float | None = None
    """The LM head with its loss (final norm, head matmul, cross-entropy) forward + backward, measured."""
    copy_gbps: float | None = None
    """Copies on the device into an existing buffer, GB/s (bytes copied): the engine's own passes over its
    gradient buffers (copies into the flat buffers, scaling, the norm, clearing). None: not counted."""
    fresh_copy_gbps: float | None = None
    """The same into a newly allocated buffer (stages 2-3 free the whole gradient buffer after each
    reduction: on a CPU its pages come back from the OS every micro-step). None: `copy_gbps`."""
    overlap: bool = True
    """Collectives run beside compute (NCCL's own stream). False on Gloo over CPUs: they share the cores."""
    reduce_scatter_is_all_reduce: bool = False
    """Gloo has no reduce-scatter: the engine all-reduces instead (zero/grad_reducer.py)."""
    fits: dict[str, CollectiveFit] = field(default_factory=dict)
    """Per collective, fitted from `bench comm`; when present they replace the links for that collective."""
    sources: tuple[str, ...] = ()


def named_rates(device: str = "h100", intra: str | None = None, inter: str | None = None) -> Rates:
    """The named defaults: `device` ("h100", ...), its usual intra-node link, `inter` between nodes.

    Raises ValueError naming the known choices for an unknown name.
    """
    dev = _pick(_DEVICES, device, "GPU")
    intra_name = intra or _DEFAULT_INTRA[device.lower()]
    link = _pick(_INTRA, intra_name, "intra-node link")
    between = inter_node_link(inter, 8) if inter else None
    sources = [f"{dev.name}: datasheet peak x {dev.tflops / dev.peak_tflops:.0%} (zerotrain's default)",
               f"intra-node: {link.name} default"]
    if between:
        sources.append(f"inter-node: {between.name} default")
    return Rates(dev, link, between, sources=tuple(sources))


def cpu_ranks(rates: Rates) -> Rates:
    """`rates` for Gloo ranks on CPUs: no overlap (collectives run on the cores that compute), no
    reduce-scatter (the engine all-reduces), and loopback TCP between them unless `bench comm` said."""
    named = tuple(s for s in rates.sources if not s.startswith("intra-node:"))
    return replace(rates, intra=_INTRA["gloo-loopback"], overlap=False, reduce_scatter_is_all_reduce=True,
                   sources=named + ("intra-node: Gloo over loopback TCP default",))


def inter_node_link(name: str, gpus_per_node: int) -> Link:
    """The inter-node link `name` for nodes of `gpus_per_node` GPUs (per-GPU NICs scale with it)."""
    gbit, nics, efficiency, words = _pick(_INTER, name, "inter-node link")
    count = gpus_per_node if nics is None else nics
    return Link(f"{name} ({words})", gbit / 8 * count * efficiency, _INTER_LATENCY_S)


def with_inter_node(rates: Rates, name: str, gpus_per_node: int, assumed: bool = False) -> Rates:
    """`rates` with the inter-node link `name`, recorded in its sources ("(assumed)" when nobody named it)."""
    return replace(rates, inter=inter_node_link(name, gpus_per_node),
                   sources=rates.sources + (f"inter-node: {name}" + (" (assumed)" if assumed else ""),))


def _pick(table: dict, name: str, what: str):
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)}") from None


def with_compute_probe(rates: Rates, path: str | Path) -> Rates:
    """`rates` with the device's rates from a `zerotrain bench compute --json` file."""
    data = _read_json(path, "zerotrain-bench-compute", "zerotrain bench compute --json FILE")
    try:
        tflops = float(data["matmul_tflops"])
        dev = replace(
            rates.device,
            name=str(data.get("device") or rates.device.name),
            tflops=tflops,
            peak_tflops=data.get("peak_tflops") if data.get("device_type") == "cuda" else None,
            optimizer_elements_per_s=float(data.get("device_adam_elements_per_s") or rates.device.optimizer_elements_per_s),
            host_link_gbps=float(data.get("host_to_device_gbps") or rates.device.host_link_gbps),
        )
        cpu_adam = float(data.get("cpu_adam_elements_per_s") or rates.cpu_adam_elements_per_s)
        attention = data.get("attention_tflops")
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a bench compute result ({error!r} missing or wrong)") from None
    on_cpu = data.get("device_type") == "cpu"
    named = tuple(s for s in rates.sources if not s.startswith(rates.device.name))  # the probe replaces them
    layer, head = data.get("layer_tflops"), data.get("head_tflops")
    copy, fresh = data.get("copy_gbps"), data.get("fresh_copy_gbps")
    return replace(rates, device=dev, cpu_adam_elements_per_s=cpu_adam,
                   attention_tflops=float(attention) if attention else None,
                   layer_tflops=float(layer) if layer else None, head_tflops=float(head) if head else None,
                   copy_gbps=float(copy) if copy else None, fresh_copy_gbps=float(fresh) if fresh else None,
                   overlap=rates.overlap and not on_cpu,
                   sources=named + (f"compute: measured by bench compute ({path})",))


def with_comm_probe(rates: Rates, path: str | Path) -> Rates:
    """`rates` with collective times fitted from a `zerotrain bench comm --json` file."""
    data = _read_json(path, None, "zerotrain bench comm HOSTFILE --json FILE")
    rows = ((data.get("all_nodes") or {}).get("rows")) if isinstance(data, dict) else None
    if not rows:
        raise ValueError(f"{path}: no measured rows (all_nodes.rows); is it a `bench comm --json` result?")
    fits = {}
    for collective in ("all_reduce", "all_gather", "reduce_scatter"):
        mine = [r for r in rows if r.get("collective") == collective and r.get("time_s")]
        if len(mine) >= 2:
            fits[collective] = fit_collective(mine)
    if not fits:
        raise ValueError(f"{path}: too few rows to fit (need 2 sizes of one collective)")
    gloo = data.get("backend") == "gloo"
    return replace(rates, fits=fits, overlap=rates.overlap and not gloo,
                   reduce_scatter_is_all_reduce=gloo or rates.reduce_scatter_is_all_reduce,
                   sources=rates.sources + (f"collectives: fitted to bench comm ({path}, {data.get('ranks')} ranks, "
                                            f"{data.get('backend')})",))


def fit_collective(rows: list[dict]) -> CollectiveFit:
    """Least squares of t = a + S * factor / busbw over the measured sizes (bench comm's rows).

    Fitted on the larger half of the sizes for the bandwidth (small ones are latency), and the
    fixed cost is the median residual of the small ones, so neither end pulls the other.
    """
    ranks = int(rows[0]["ranks"])
    factor = bus_factor(rows[0]["collective"], ranks)
    points = sorted((float(r["size"]) * factor, float(r["time_s"])) for r in rows)
    big = points[len(points) // 2:]
    xs, ts = [p[0] for p in big], [p[1] for p in big]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else mt / mx
    slope = max(slope, 1e-15)
    fixed = statistics.median(max(0.0, t - x * slope) for x, t in points)
    measured = tuple(sorted((float(r["size"]), float(r["time_s"])) for r in rows))
    return CollectiveFit(fixed, 1.0 / slope / GB, ranks, measured)


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n (as
    bench/bandwidth.py, which `bench` owns: planning does not import the tools above it)."""
    return (2 if collective == "all_reduce" else 1) * (ranks - 1) / ranks


def _read_json(path: str | Path, kind: str | None, how: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; make it with `{how}`") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(data, dict) or (kind and data.get("kind") != kind):
        raise ValueError(f"{path}: not a `{how}` result")
    return data
