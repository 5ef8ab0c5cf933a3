"""Writes docs/planning.md from the planning tools' own output: `python docs/generate_planning.py`.

Every block of output in that page is produced here by running the command shown above it
(in-process, from the repository root), so the page cannot drift from the tools:
tests/planning/test_planning_docs.py fails when the file differs from `render()`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "planning.md"

INTRO = """\
# Planning: which ZeRO configuration, on how many GPUs

"Do I need several GPUs to train this model?", "How much memory will each GPU hold?", "Which ZeRO
stage and offload should I use?" The guides answer with DeepSpeed's estimator functions and a
nine-step procedure in which every step is a failed run: batch 1 with gradient checkpointing,
stage 2, stage 2 with optimizer offload, stage 3, parameter offload, optimizer offload, smaller
buffers, bf16, NVMe. zerotrain walks the same steps on a memory model before any run, then
confirms the answer with one:

| command | answers |
| --- | --- |
| `zerotrain estimate MODEL` | the memory of every rung, per GPU and per node (`--deepspeed-format`: DeepSpeed's tables) |
| `zerotrain plan MODEL --gpus 8 --gpu-memory 80GiB --global-batch 256` | the rung predicted fastest that fits, micro-batch and accumulation, each rung's predicted tokens/s and MFU, the minimum GPU count; `--scale 8,64,512` the same at other GPU counts; `--verify` runs 3 real steps |
| `zerotrain plan MODEL --gpus 8 --gpu-memory 80GiB --max-seq-len` | the longest sequence the model trains on those GPUs, what to switch on to go longer, and the train YAML that runs it (also `estimate --max-seq-len`; [below](#long-sequences)) |
| `zerotrain init` | the config wizard: `accelerate config`'s questions, each answered with its estimate (below) |
| `zerotrain tune TRAIN_YAML` | times the candidates that fit, in one job, and picks the fastest ([tuning.md](tuning.md)) |

MODEL is a local Hugging Face directory or `config.json`, a `zerotrain train` YAML, or an
architecture name sized with `--config-override`. The model is built on the meta device: no
weights are read and nothing is downloaded. The examples below use the configs of Llama 3.2 1B,
Llama 2 7B and Llama 3 70B, shipped with zerotrain: name them (`llama-3.2-1b`,
`llama-2-7b`, `llama-3-70b`) from any folder; their config.json files are in
`zerotrain/planning/model_presets/` (`examples/models/` in a checkout).

For a train YAML the planners describe the job `zerotrain train` starts from it on this machine:
unless flags say otherwise (`--gpus`, `--gpus-per-node`, `--dtype`, `--global-batch`), the GPU count
is the processes train starts here (every GPU, else 2 CPU ranks), the dtype is `training.precision`
as train resolves it (`auto`: bf16 on a bf16 GPU, fp32 on a CPU) and `plan`'s global batch is the
YAML's micro-batch x accumulation x that count; one `assumed:` line says what was taken. `plan
--scale 8,64,512` without `--gpus` makes its plan at the smallest count of the list.

## The ladder

The rungs, fastest first: stage 0 (plain data parallel), 1, 2, 2 + optimizer on CPU, 3, 3 +
optimizer on CPU, 3 + optimizer and parameters on CPU, then the NVMe rungs (with `--nvme PATH`).
Each is tried without gradient checkpointing, with selective checkpointing (matmul and attention
outputs kept, the cheap ops recomputed: `training.gradient_checkpointing: selective` in
`zerotrain train`) and with whole layers recomputed. `--loss-chunk-tokens N` (or a train YAML's
`training.loss_chunk_tokens`) counts the chunked loss, which holds one chunk's logits instead of
all of them. Every rung gets the largest
micro-batch that fits and divides the per-GPU share of the global batch (accumulation makes up
the rest), and the step-time model (below) predicts its step; the plan is the fastest that fits
(within 3%, the model's resolution, the earlier rung). It says why the winner wins: "stage 2: 6%
slower than stage 1 would be, but stage 1 does not fit".

## What is counted, per GPU

| term | what it is |
| --- | --- |
| params, grads, optim | parameters in the compute dtype, gradients, fp32 master + optimizer state: the bytes the engine allocates, padding included (`engine.memory_breakdown()` matches them to the byte; tested at every stage and CPU offload on 1, 2 and 4 ranks) |
| buckets | stages 2-3: whole-gradient buckets alive in backward (one filling, two awaiting their reduce-scatter) |
| gathered | stage 3: the root unit (embeddings, head) for the whole step, and layers gathered up to `stage3_max_live_parameters` |
| activ | what autograd keeps for backward, per layer from the architecture (eager attention keeps the score matrices, SDPA does not); with checkpointing, each layer's input plus one layer recomputed |
| logits | the LM head's peak: logits, their fp32 copy for the loss, and its gradient |

On the CPU, per node (offloaded rungs), besides the offloaded states themselves:

| term | what it is |
| --- | --- |
| optimizer step temporaries | the offloaded step's fp32 copy of one sub-group's gradients and one bucket's, for the norm |
| pinned-memory rounding | torch's pinned allocator (`tensor.pin_memory()`) rounds each buffer up to a power of two, and the engine pins per bucket (master, gradient and stage-3 parameter shards): a 486M-element bucket pins 2 GiB for its 1.8 GiB fp32 master |
| nvme swap buffers | NVMe rungs: the host buffers a shard passes through on its way to and from disk |

A rung fits when the GPU total plus a reserve (5% of the GPU, at least 1 GiB: CUDA context, NCCL
buffers, allocator fragmentation) is within `--gpu-memory`, and the CPU bytes of its node's
processes plus a reserve (2 GiB for the OS, 4 GiB per process for its CUDA context and libraries;
measured on an H100 machine: 1.8 GiB and 3.6 GiB) within `--cpu-memory` (`plan` without it: this
machine's memory, said in its first line). NVMe bytes are what the shards take on disk.

Sizes follow one rule in every command (`plan`, `estimate`, `init`, `tune`, `consolidate`; one
parser, zerotrain/config/byte_sizes.py): GB and TB are powers of 10 (80GB = 80 x 10^9 bytes), as
Hugging Face and DeepSpeed read `max_shard_size="5GB"`; GiB and TiB are powers of 2 (80GiB = 80 x
2^30 bytes); a bare G or T is refused as ambiguous, and `--gpu-memory`/`--cpu-memory` need a unit.
A GPU sold as "80 GB" holds about 80 GiB (an H100 reports 81559 MiB), so give `--gpu-memory 80GiB`
for it: 80GB is 74.5 GiB, and the planners say so when given it. The GPU's speed is still named
from its memory either way (80GiB or 80GB: h100).
"""

EXAMPLES = [
    ("A 1B model on one 24 GiB GPU",
     "A single consumer or workstation GPU: does Llama 3.2 1B train at sequence length 2048?",
     "plan llama-3.2-1b --gpus 1 --gpu-memory 24GiB --cpu-memory 64GiB --seq-len 2048 "
     "--global-batch 16"),
    ("A 7B model on 8 x 80 GiB",
     "One node of eight 80 GiB GPUs. First the memory of every rung, then the plan.",
     "estimate llama-2-7b --gpus-per-node 8 --gpu-memory 80GiB --cpu-memory 1TiB --seq-len 4096 "
     "--micro-batch 4"),
    (None, None,
     "plan llama-2-7b --gpus 8 --gpu-memory 80GiB --cpu-memory 1TiB --seq-len 4096 "
     "--global-batch 256"),
    ("A 70B model on 4 nodes x 8 x 80 GiB",
     "Thirty-two GPUs, 1 TiB of CPU memory per node.",
     "plan llama-3-70b --gpus 32 --gpus-per-node 8 --gpu-memory 80GiB --cpu-memory 1TiB "
     "--seq-len 4096 --global-batch 512"),
    ("DeepSpeed's estimate, for comparison",
     "`--deepspeed-format` prints what DeepSpeed's `estimate_zero3_model_states_mem_needs_all_live` prints "
     "(model states only, with its 1.5 CPU buffer factor); the same functions are importable under "
     "DeepSpeed's names in the stand-in.",
     "estimate llama-2-7b --gpus-per-node 8 --deepspeed-format"),
]

LONG_SEQUENCES = """\
## Long sequences

`--max-seq-len` answers "what is the longest sequence this model trains on these GPUs?": for each
rung, the longest length (at micro-batch 1, in steps of 1,024 tokens and of the sequence-parallel
size) whose memory fits, the longest of them with what runs out one step further, then each
long-sequence switch left off turned on alone and all together, and the `zerotrain train` YAML
of the answer. Only the activations grow with the sequence, so each rung is estimated once and
the length found by bisection; the answer is estimated again in full. The switches, as flags or
from a train YAML:

| flag | train YAML | what the memory model counts |
| --- | --- | --- |
| `--sequence-parallel N` | `training.sequence_parallel_size: N` | each rank's activations and logits at seq/N; the attention kernel's output (no longer shared with o_proj's input), key/value heads replicated up to N when there are fewer, and the all-to-all's send and receive buffers of q; model states still shard over every rank |
| `--tiled-mlp [TOKENS]` | `training.tiled_mlp: true` (or tokens per tile) | the MLP keeps only its input; backward's recompute of one tile (as long as the model is wide, DeepSpeed's rule) holds its intermediates and their gradients. With selective checkpointing nothing is saved: its policy keeps the tiles' matmul outputs |
| `--offload-activations` | `training.offload_activations: true` | each checkpointed layer's input moves to host memory, pinned (a power of two each), counted per node against `--cpu-memory` (rungs with checkpointing only) |
| `--loss-chunk-tokens N` | `training.loss_chunk_tokens: N` | one chunk's logits at a time |

The terms are checked against a tiny Llama on the CPU, op by op (every storage a forward and
backward makes, followed until it is freed; tests/planning/test_long_sequence_memory_measured.py):
the bytes alive after the forward are within 10% of the model's saved activations at 256-1,024
tokens, with tiled MLP, offload and both, and on each of 2 ranks at sequence parallel 2; offloaded
bytes equal the model's exactly (unpinned on a CPU); the model's peak is never under the
measured peak and at most 25% over it (+0.1% to +21% measured: the saved tensors plus the larger
of the loss's backward and one layer's, which never coexist; the layer's is the recompute, the
transients and two gradients of the MLP's width).
`estimate MODEL --seq-len S` with the same flags gives every rung's memory at one length; `plan`
without `--max-seq-len` plans data parallelism alone and refuses the first three flags.
"""

WIZARD = """\
## The config wizard

`zerotrain init [MODEL]` asks what `accelerate config` asks for DeepSpeed (machines, GPUs per
machine, mixed precision, ZeRO stage, optimizer and parameter offload, zero.Init, accumulation,
clipping) plus the GPU and CPU memory, sequence length and global batch, then the run: learning
rate, optimizer steps and run directory. Each question shows the estimate behind it, and its
default, in brackets, is the plan's answer. The number of GPUs and the memory of one default to
this machine's (torch.cuda); on a machine without a GPU the memory has no default and must be
answered. Answers come from flags (one per question), then from standard input, one line each
(an empty line takes the default); `--yes` takes the defaults for the rest. An answer a question
cannot use is asked again, with the reason and the answers it accepts; a wrong flag stops with
them.

The ZeRO stage question shows a table with a line per term of the estimate (parameters,
gradients, master and optimizer state, gradient buckets, gathered units, activations, logits)
and a column per stage, then what each line is. On a small model the estimate can put stages 2
and 3 above stage 1: in backward they build whole-gradient buckets of `reduce_bucket_size`
elements (up to 3 alive until reduce-scattered), and stage 3 keeps layers gathered up to
`stage3_max_live_parameters`; with a model of a few buckets these terms outweigh what sharding
saves. Each term is counted at its largest, and the wizard names the terms that differ.

A configuration that does not fit is shown with its overflow and written only when confirmed. It
writes `ds_config.json`, a `zerotrain train` YAML (`zerotrain.yaml`) and, with
`--accelerate-config PATH`, an Accelerate config that uses the JSON. The two agree: the same
AdamW settings (learning rate, betas, eps, weight decay) in both, a constant learning rate in both
(the JSON has no scheduler). The YAML runs as written: steps, an absolute run directory, and
generated data (`data.format: synthetic`) to replace with `data.path`; its model trains from
scratch unless `model.path` names a local directory with weights. Existing files are kept unless
`--force`.
"""

INIT_COMMAND = ("init llama-2-7b --nodes 1 --gpus-per-node 8 --gpu-memory 80GiB "
                "--cpu-memory 1TiB --seq-len 4096 --global-batch 256 --yes")

SPEED = """\
## Step time: which rung is fastest

`plan` times every rung with a model of one optimizer step (`zerotrain/planning/step_time.py`):

- **compute**: forward and backward FLOPs of the micro-batch counted from the model's sizes as the
  flops profiler counts them (every linear layer, attention's QK^T and AV over the full square;
  recompute of the layers with gradient checkpointing), over an achievable rate: the GPU's
  datasheet peak x one efficiency per GPU model (`--gpu h100|a100-80gb|...`), or what
  `zerotrain bench compute --json F` measured on this machine (`--compute F`);
- **communication**: the collectives the engine issues at that stage, from its own bucket plan
  (all-reduce or reduce-scatter per gradient bucket, stage 3's all-gather per unit in forward and
  again in backward for the units the live limit did not keep, stages 1-2's gather of the updated
  parameters), each timed as ring latency + bytes / bus bandwidth over the topology (NVLink or PCIe
  inside a node, the node's NICs between nodes, NCCL's tree for all-reduce when it is faster), from
  named links (`--intra-node nvlink4`, `--inter-node ib-ndr`, ...) or fitted to
  `zerotrain bench comm HOSTFILE --json F` (`--comm F`);
- **overlap**: a timeline per micro-step with one compute and one communication stream: a
  bucket's reduction runs beside the rest of backward, stage 3's gathers are prefetched one unit
  ahead; what the step waits for is the exposed share. On Gloo (CPUs) nothing overlaps;
- **offload**: the gradient and parameter copies over PCIe and the CPU optimizer (shared by a
  node's processes), NVMe traffic for the NVMe rungs; none of it hides.

`zerotrain tune TRAIN_YAML --compute F` runs its trials in predicted order and writes measured beside
predicted in `autotuning_results/summary.txt`.

`--scale` runs the model at other GPU counts at the same global batch (strong scaling), for stages
0-3: per GPU, compute falls with the share of the batch while each rank's bytes per step stay
(2x the gradients below stage 3, up to 3x at stage 3), so from some count the step waits on
communication. `--plot F.png` draws the curves.

"""

OUTRO = """\
## Confirming a plan

`zerotrain plan ... --verify` runs three real steps of the recommended config on this machine's
devices (random tokens, random weights; one process per GPU, or Gloo processes on a CPU) and
prints measured against predicted bytes: the model states from `engine.memory_breakdown()`, the
activations autograd saved, and on a GPU the allocator's peak. A rung that runs out of memory, or
whose peak is over `--gpu-memory`, is dropped and the plan falls to the next rung, saying so.

## Limits

- The activation model covers Llama-family (Llama, Mistral, Qwen2) and GPT-2 architectures.
- NVMe rungs report the bytes parked on disk; the host buffers they swap through are estimated,
  not measured.
- No tensor or pipeline parallelism: beyond data-parallel ZeRO, only sequence parallelism
  (`--max-seq-len` with `--sequence-parallel`) shrinks a sample's activations per GPU.
- `--max-seq-len` does not cap the answer at the model's `max_position_embeddings`; it says when
  the answer is beyond it (rope scaling is then needed).

This page is generated: `python docs/generate_planning.py` rewrites it from the tools' output.
"""


LONG_COMMAND = "plan llama-2-7b --gpus 8 --gpu-memory 80GiB --cpu-memory 1TiB --max-seq-len"

SCALE_COMMAND = ("plan llama-2-7b --gpus 8 --gpu-memory 80GiB --cpu-memory 1TiB --seq-len 4096 --global-batch 1024 "
                 "--gpu h100 --inter-node ib-ndr --scale 8,64,256,1024")


def _scale_only(text: str) -> str:
    """The --scale table of a plan's output (the rest is in the worked examples)."""
    return text[text.index("Scaling at the same global batch"):]


def run_cli(command: str, where: Path = ROOT) -> str:
    """`zerotrain COMMAND` in-process, run from `where` with examples/ paths made absolute; its output."""
    from zerotrain.cli.main import main

    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stdout(out):
            main([str(ROOT / w) if w.startswith("examples/") else w for w in shlex.split(command)])
    finally:
        os.chdir(cwd)
    return out.getvalue().replace(str(ROOT) + "/", "")


def render() -> str:
    """The page, with every example's output produced now."""
    parts = [INTRO, "## Worked examples\n"]
    for title, words, command in EXAMPLES:
        if title:
            parts.append(f"### {title}\n\n{words}\n")
        parts.append(f"```console\n$ zerotrain {command}\n{run_cli(command).rstrip()}\n```\n")
    parts.append(LONG_SEQUENCES)
    parts.append(f"```console\n$ zerotrain {LONG_COMMAND}\n{run_cli(LONG_COMMAND).rstrip()}\n```\n")
    parts.append(WIZARD)
    with tempfile.TemporaryDirectory() as folder:  # the files it writes are not part of the page
        transcript = run_cli(INIT_COMMAND, Path(folder))
    parts.append(f"```console\n$ zerotrain {INIT_COMMAND}\n{transcript.rstrip()}\n```\n")
    parts.append(SPEED)
    parts.append(f"```console\n$ zerotrain {SCALE_COMMAND}\n{_scale_only(run_cli(SCALE_COMMAND)).rstrip()}\n```\n")
    for name in ("cpu_validation.md", "gpu_validation.md", "published.md"):
        table = ROOT / "benchmarks" / "step_time" / name
        if table.is_file():  # the measured tables, made by their scripts (the commands are in them)
            parts.append(table.read_text().rstrip() + "\n")
    parts.append(OUTRO)
    return "\n".join(parts)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
