"""A tiny checkpoint writer for tests: the on-disk format of layout.py, written directly.

It does not go through the engine or the saver, so the reading side (reader,
consolidation, export) is tested against the format itself, with slices split
over several fake ranks the way a ZeRO run writes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zerotrain.checkpoint.layout import (
    FORMAT, LATEST, MASTER, META, MODULE, param_slices_in, save_range, shard_file, slice_key,
)

# Fake per-element optimizer state, derived from the master so a mix-up would show.
STATE_KINDS = {"exp_avg": 0.5, "exp_avg_sq": 0.25}


def write_checkpoint(
    save_dir: Path,
    params: dict[str, torch.Tensor],
    *,
    module: dict[str, torch.Tensor] | None = None,
    tag: str = "global_step1",
    world_size: int = 3,
    buckets: int = 2,
    with_optimizer_state: bool = True,
    hf_config: dict | None = None,
    compute_dtype: str = "fp32",
    write_latest: bool = True,
) -> Path:
    """Writes `params` (trainable, fp32 masters) and `module` (stored whole) as a checkpoint; returns the tag dir.

    Parameters are cut into `buckets` flat buffers (padded to a multiple of
    `world_size`); rank r writes part r of each, so parameters straddle files.
    """
    tag_dir = Path(save_dir) / tag
    tag_dir.mkdir(parents=True)
    names = list(params)
    per_bucket = -(-len(names) // buckets) if names else 1
    rank_tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    files: dict[str, list] = {shard_file(r): [] for r in range(world_size)}
    for b in range(0, len(names), per_bucket):
        bucket = names[b : b + per_bucket]
        numels = [params[n].numel() for n in bucket]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        flat = torch.cat([params[n].detach().float().reshape(-1) for n in bucket])
        padded = -(-flat.numel() // world_size) * world_size
        for rank in range(world_size):
            lo, hi = save_range(padded, rank, world_size)
            for name, start, numel, at in param_slices_in(bucket, offsets, numels, lo, hi):
                piece = flat[at : at + numel].clone()
                rank_tensors[rank][slice_key(MASTER, name, start)] = piece
                if with_optimizer_state:
                    for kind, factor in STATE_KINDS.items():
                        rank_tensors[rank][slice_key(kind, name, start)] = piece * factor
                files[shard_file(rank)].append([name, start, numel])
    for name, t in (module or {}).items():
        rank_tensors[0][slice_key(MODULE, name, 0)] = t.detach().contiguous().clone()
    for rank, tensors in enumerate(rank_tensors):
        save_file(tensors, str(tag_dir / shard_file(rank)), metadata={"format": FORMAT})
    meta = {
        "format": FORMAT,
        "tag": tag,
        "world_size": world_size,
        "stage": 2,
        "compute_dtype": compute_dtype,
        "counters": {"global_steps": 1, "micro_steps": 1, "skipped_steps": 0, "global_samples": 2},
        "params": {n: {"shape": list(params[n].shape), "group": 0} for n in names},
        "module": {
            n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in (module or {}).items()
        },
        "kinds": [MASTER, *STATE_KINDS] if with_optimizer_state else [MASTER],
        "files": files,
        "hf_config": hf_config,
    }
    (tag_dir / META).write_text(json.dumps(meta, indent=1))
    if write_latest:
        (Path(save_dir) / LATEST).write_text(tag)
    return tag_dir


def small_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """A handful of odd-sized parameters, so that slices cut parameters at uneven places."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (13, 7), "layer.0.weight": (7, 7), "layer.0.bias": (7,), "layer.1.weight": (5, 7),
              "norm.weight": (5,), "head.weight": (11, 5), "scalar": ()}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def tiny_llama(tied: bool = True, seed: int = 0):
    """A 2-layer Llama with hidden size 32 and vocabulary 64 (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def checkpoint_of_model(save_dir: Path, model: torch.nn.Module, **kwargs) -> Path:
    """A checkpoint of `model` as the saver lays it out: trainable parameters once (tied ones by their first name)."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    module = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items() if id(t) not in trainable}
    kwargs.setdefault("hf_config", model.config.to_dict() if hasattr(model, "config") else None)
    return write_checkpoint(save_dir, params, module=module, **kwargs)


MODULE_ENTRIES = {"frozen.weight": torch.linspace(-1, 1, 6).reshape(2, 3), "steps": torch.arange(4)}


def small_checkpoint(tmp_path: Path, **kwargs) -> tuple[Path, dict[str, torch.Tensor]]:
    """tmp_path/ckpt holding small_params() and two module entries (one an integer buffer); and those tensors."""
    params = small_params()
    write_checkpoint(tmp_path / "ckpt", params, module=MODULE_ENTRIES, **kwargs)
    return tmp_path / "ckpt", {**params, **MODULE_ENTRIES}


def load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the .safetensors files among `files`."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.name.endswith(".safetensors"):
            out.update(load_file(f))
    return out


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes and values, bit for bit."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def logits_of(model, seed: int = 1) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens).logits


def from_pretrained(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


# Runs in a fresh process: real RSS (torch allocates outside Python's tracemalloc), with the
# peak (VmHWM) reset just before the measured call so imports do not count. Where the reset is
# refused the import peak stays in, which can only overstate the growth.
MEASURE_PEAK = r"""
import json, sys
import torch
from zerotrain.checkpoint import consolidate, load_consolidated_state_dict

def status_bytes(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

torch.ones(1) + 1
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before = status_bytes("VmRSS")
if sys.argv[1] == "consolidate":
    consolidate(sys.argv[2], sys.argv[3], max_shard_size="20MB")
else:
    state = load_consolidated_state_dict(sys.argv[2])
print(json.dumps({"growth": status_bytes("VmHWM") - before}))
"""


def peak_rss_growth(*args: str) -> int:
    """Bytes a fresh process's peak RSS grows by in `consolidate` ("consolidate", CKPT, OUT) or
    `load_consolidated_state_dict` ("state_dict", CKPT)."""
    run = subprocess.run(
        [sys.executable, "-c", MEASURE_PEAK, *args], capture_output=True, text=True, timeout=240,
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])["growth"]
