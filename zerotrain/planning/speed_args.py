"""The hardware-speed flags of `plan` and `tune`, and the `Rates` they make.

    --gpu h100|a100-80gb|...   the device's named defaults (datasheet peak x one efficiency)
    --intra-node nvlink4|...   the link between a node's GPUs (default: the device's usual one)
    --inter-node ib-ndr|...    the link between nodes (default: the device generation's InfiniBand)
    --compute FILE             `zerotrain bench compute --json` measured here: replaces the device's rates
    --comm FILE                `zerotrain bench comm --json`: collectives fitted to the measured times
"""

from __future__ import annotations

import argparse

from zerotrain.planning.hardware_rates import (
    DEVICE_NAMES, INTER_NAMES, INTRA_NAMES, Rates, named_rates, with_comm_probe, with_compute_probe, with_inter_node,
)

# The InfiniBand of each generation's usual cluster: what a plan across nodes assumes unless told.
USUAL_INTER = {"h100": "ib-ndr", "h200": "ib-ndr", "h100-pcie": "ib-ndr", "a100-80gb": "ib-hdr",
                "a100-40gb": "ib-hdr", "v100": "ib-edr", "l40s": "200gbe"}
# A GPU-memory size that names the device when --gpu is not given: the size it is sold as ("80 GB").
_BY_MEMORY_SOLD = {80: "h100", 141: "h200", 40: "a100-40gb", 32: "v100", 48: "l40s"}


def add_speed_args(parser: argparse.ArgumentParser) -> None:
    """Adds --gpu, --intra-node, --inter-node, --compute and --comm."""
    parser.add_argument("--gpu", choices=DEVICE_NAMES, default=None, type=str.lower,
                        help="the GPU, for its speed (default: from --gpu-memory: 80GiB h100, 40GiB a100-40gb, "
                        "32GiB v100, 141GiB h200, 48GiB l40s, in GiB or GB; else h100)")
    parser.add_argument("--intra-node", choices=INTRA_NAMES, default=None, type=str.lower,
                        help="link between a node's GPUs (default: the GPU's usual one, e.g. nvlink4 for h100)")
    parser.add_argument("--inter-node", choices=INTER_NAMES, default=None, type=str.lower,
                        help="link between nodes (default: ib-ndr for H100/H200, ib-hdr for A100, ib-edr for V100)")
    parser.add_argument("--compute", metavar="FILE", default=None,
                        help="rates measured by `zerotrain bench compute --json FILE` (replace the GPU's defaults)")
    parser.add_argument("--comm", metavar="FILE", default=None,
                        help="collective times measured by `zerotrain bench comm HOSTFILE --json FILE`")


def rates_from_args(args: argparse.Namespace, gpus_per_node: int) -> tuple[Rates, list[str]]:
    """The Rates the flags describe, and what was assumed (lines to print). ValueError on a bad file."""
    assumed = []
    device = args.gpu
    if device is None:
        named = device_by_memory(args.gpu_memory)
        device = named or "h100"
        assumed.append(f"GPU speed: {device} (from --gpu-memory; give --gpu to say which)"
                       if named else "GPU speed: h100 (give --gpu to say which)")
    inter = args.inter_node or USUAL_INTER[device]
    rates = with_inter_node(named_rates(device, args.intra_node, None), inter, gpus_per_node,
                            assumed=not args.inter_node)
    if args.compute:
        rates = with_compute_probe(rates, args.compute)
    if args.comm:
        rates = with_comm_probe(rates, args.comm)
    return rates, assumed


def device_by_memory(gpu_memory: int | None) -> str | None:
    """The named GPU whose memory `gpu_memory` is, or None. A card sold as N GB holds about N GiB (torch
    reports an H100 80GB as 79.2 GiB, an H200 141GB as 140.4 GiB): within 3% of N GiB, or N GB exactly as
    a user may write it (80GB = 80e9 bytes)."""
    if not gpu_memory:
        return None
    for sold, device in _BY_MEMORY_SOLD.items():
        if abs(gpu_memory / 2**30 - sold) <= 0.03 * sold or gpu_memory == sold * 10**9:
            return device
    return None

