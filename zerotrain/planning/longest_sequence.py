"""The longest sequence a model trains on given GPUs: `zerotrain estimate|plan MODEL --max-seq-len`.

For every rung of the ladder (stage, offload, checkpointing) the longest sequence length at
micro-batch 1 whose memory fits, under the long-sequence switches asked for (sequence
parallelism, tiled MLP, offloaded activations, chunked loss). Only activations grow with the
sequence, so each rung's model states and buffers are estimated once (`estimate_rung`) and the
length is found by bisection on `estimate_activations` alone; the answer is estimated again in
full, so what is printed is exactly `estimate_rung`'s verdict. Then each switch left off is tried
on, to say what to turn on to go longer, and the answer is written as the `zerotrain train` YAML
keys that run it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from zerotrain.planning.activation_memory import LongSequence, estimate_activations
from zerotrain.planning.ladder import Rung, ladder
from zerotrain.planning.rung_memory import DTYPES, Hardware, RungEstimate, Workload, estimate_rung, rung_config

GRAIN = 1024
"""Lengths are answered in multiples of this (and of the sequence-parallel size)."""
LIMIT = 1 << 32
"""Longest length searched (tokens per sample)."""
SUGGESTED_LOSS_CHUNK = 4096
"""Tokens per chunk suggested for the chunked loss (one chunk's fp32 logits at a time)."""


@dataclass
class RungLongest:
    """One rung's longest sequence at micro-batch 1, and its estimate there (None: not even GRAIN fits)."""

    rung: Rung
    seq_len: int
    estimate: RungEstimate | None


@dataclass
class LongestAnswer:
    """The longest sequence over the ladder for one workload, with every rung's."""

    workload: Workload
    """The switches asked for; `seq_len` is the answer (0 when nothing fits)."""
    best: RungLongest | None
    rungs: list[RungLongest]

    @property
    def seq_len(self) -> int:
        return self.best.seq_len if self.best else 0


def longest_sequence(model: nn.Module, hardware: Hardware, workload: Workload, base_config: dict | None = None,
                     checkpointing: bool | None = None) -> LongestAnswer:
    """The longest `seq_len` (micro-batch 1) each rung fits on `hardware` with `workload`'s switches.

    Rungs without checkpointing are left out when activations are offloaded (only checkpointed
    layers offload). Ties go to the earlier (faster) rung of the ladder.
    """
    grain = math.lcm(GRAIN, workload.long_sequence.sequence_parallel)
    rungs = []
    for rung in ladder(allow_nvme=hardware.nvme_path is not None, checkpointing=checkpointing):
        if workload.long_sequence.offload_activations and not rung.gradient_checkpointing:
            continue
        rungs.append(_rung_longest(model, rung, replace(workload, micro_batch=1), hardware, base_config, grain))
    best = max((r for r in rungs if r.seq_len), key=lambda r: r.seq_len, default=None)
    return LongestAnswer(replace(workload, micro_batch=1, seq_len=best.seq_len if best else 0), best, rungs)


def _rung_longest(model: nn.Module, rung: Rung, work: Workload, hardware: Hardware, base: dict | None,
                  grain: int) -> RungLongest:
    first = estimate_rung(model, rung, replace(work, seq_len=grain), hardware, base)
    if not first.fits:
        return RungLongest(rung, 0, None)
    # What does not grow with the sequence: everything but the activation terms.
    act_terms = ("activations", "logits peak")
    gpu_fixed = first.gpu_total - sum(first.gpu.get(k, 0) for k in act_terms)
    cpu_fixed = first.cpu_total - first.cpu_per_node.get("offloaded activations", 0)

    def fits(seq: int) -> bool:
        act = estimate_activations(model.config, seq, 1, DTYPES[work.dtype], work.attention,
                                   loss_chunk_tokens=work.loss_chunk_tokens, long_sequence=work.long_sequence)
        gpu = gpu_fixed + act.total(rung.gradient_checkpointing) + hardware.gpu_reserve
        if hardware.gpu_memory is not None and gpu > hardware.gpu_memory:
            return False
        cpu = cpu_fixed + act.host(rung.gradient_checkpointing) * hardware.gpus_per_node
        return hardware.cpu_memory is None or not cpu or cpu + hardware.cpu_reserve <= hardware.cpu_memory

    low, high = 1, LIMIT // grain  # fits(low * grain); bisect for the last k that fits
    if fits(high * grain):
        low = high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * grain) else (low, mid)
    est = estimate_rung(model, rung, replace(work, seq_len=low * grain), hardware, base)
    return RungLongest(rung, low * grain if est.fits else 0, est if est.fits else None)


def switches_to_go_longer(model: nn.Module, hardware: Hardware, answer: LongestAnswer, base: dict | None = None,
                          checkpointing: bool | None = None) -> list[tuple[str, LongestAnswer]]:
    """Each long-sequence switch that is off, turned on alone, then all of them, with the longest
    sequence each reaches: [(the YAML key as it would be set, answer)], longest first."""
    work, ls = answer.workload, answer.workload.long_sequence
    options: list[tuple[str, Workload]] = []
    if not ls.tiled_mlp:
        options.append(("training.tiled_mlp: true", replace(work, long_sequence=replace(ls, tiled_mlp=True))))
    if not ls.offload_activations and checkpointing is not False:
        options.append(("training.offload_activations: true",
                        replace(work, long_sequence=replace(ls, offload_activations=True))))
    if not work.loss_chunk_tokens:
        options.append((f"training.loss_chunk_tokens: {SUGGESTED_LOSS_CHUNK}",
                        replace(work, loss_chunk_tokens=SUGGESTED_LOSS_CHUNK)))
    sp = _widest_sequence_parallel(model, hardware.world_size)
    if sp > ls.sequence_parallel:
        options.append((f"training.sequence_parallel_size: {sp}",
                        replace(work, long_sequence=replace(ls, sequence_parallel=sp))))
    if len(options) > 1:
        every = LongSequence(max(sp, ls.sequence_parallel), ls.tiled_mlp or True,
                             ls.offload_activations or checkpointing is not False)
        options.append(("all of the above", replace(work, long_sequence=every,
                                                     loss_chunk_tokens=work.loss_chunk_tokens or SUGGESTED_LOSS_CHUNK)))
    found = [(label, longest_sequence(model, hardware, w, base, checkpointing)) for label, w in options]
    return sorted(found, key=lambda item: -item[1].seq_len)


def _widest_sequence_parallel(model: nn.Module, world: int) -> int:
    """The largest sequence-parallel size that divides `world` and the model's attention heads
    (sequence/attention.py's rule: KV heads divide it or it divides them)."""
    c = model.config
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", 1)
    kv = getattr(c, "num_key_value_heads", None) or heads
    sizes = [n for n in range(1, world + 1)
             if world % n == 0 and heads % n == 0 and (kv % n == 0 or n % kv == 0)]
    return max(sizes)


def train_yaml_keys(answer: LongestAnswer, base: dict | None = None, nvme_path: str | None = None) -> dict[str, Any]:
    """The `zerotrain train` YAML sections (data, training, zero) that run `answer`'s best rung."""
    assert answer.best is not None
    work, ls = answer.workload, answer.workload.long_sequence
    training: dict[str, Any] = {"micro_batch_size": 1,
                                "gradient_checkpointing": answer.best.rung.gradient_checkpointing,
                                "precision": work.dtype}
    if work.loss_chunk_tokens:
        training["loss_chunk_tokens"] = work.loss_chunk_tokens
    if ls.tiled_mlp:
        training["tiled_mlp"] = ls.tiled_mlp
    if ls.offload_activations:
        training["offload_activations"] = True
    if ls.sequence_parallel > 1:
        training["sequence_parallel_size"] = ls.sequence_parallel
    ds = rung_config(answer.best.rung, work, base, nvme_path)
    return {"data": {"seq_len": answer.seq_len}, "training": training,
            "zero": {"zero_optimization": ds["zero_optimization"]}}
