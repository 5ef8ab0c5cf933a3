"""The on-disk layout of a zerotrain checkpoint, independent of stage and world size.

    SAVE_DIR/
      latest                          text: the newest tag (replaced atomically, last)
      TAG/                            e.g. global_step100
        meta.json                     format, counters, loss scaler, parameter table, file index
        state.pt                      scheduler state and client_state (torch.load weights_only=True)
        rng_rank00000.pt              each rank's RNG states (weights_only)
        shards_rank00000.safetensors  each rank's slices of every parameter: fp32 master and
                                      optimizer state, keyed "KIND/NAME/START"

A slice is a flat element range [START, START+numel) of one parameter, so a
checkpoint describes parameters, not buckets: a loader with any world size or
stage picks out the ranges its own shards need ("resharding on load").
Frozen parameters and persistent buffers are stored whole by rank 0 under
"module/NAME".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FORMAT = "zerotrain-checkpoint/1"
META = "meta.json"
STATE = "state.pt"
LATEST = "latest"
MASTER = "master"
MODULE = "module"


def shard_file(rank: int) -> str:
    return f"shards_rank{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def slice_key(kind: str, name: str, start: int) -> str:
    return f"{kind}/{name}/{start}"


@dataclass(frozen=True)
class ParamSlice:
    """Elements [start, start + numel) of parameter `name` (flattened), stored in `file`."""

    name: str
    start: int
    numel: int
    file: str


def save_range(padded_numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The flat range of a bucket rank `rank` writes: its shard, or an equal part of a whole buffer."""
    part = math.ceil(padded_numel / world_size)
    return min(rank * part, padded_numel), min((rank + 1) * part, padded_numel)


def param_slices_in(
    names: list[str], offsets: list[int], numels: list[int], start: int, end: int
) -> list[tuple[str, int, int, int]]:
    """Parameters overlapping the flat range [start, end) of a bucket.

    Returns (name, element start within the parameter, numel, flat offset) per overlap.
    """
    out = []
    for name, off, n in zip(names, offsets, numels):
        a, b = max(start, off), min(end, off + n)
        if a < b:
            out.append((name, a - off, b - a, a))
    return out


def read_meta(tag_dir: Path) -> dict:
    """Loads and checks meta.json; errors name the file and say what is wrong."""
    from zerotrain.checkpoint.errors import CheckpointError

    path = tag_dir / META
    if not path.is_file():
        raise CheckpointError(f"{tag_dir} is not a zerotrain checkpoint: {META} is missing")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from e
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {fmt!r} (this zerotrain reads {FORMAT!r})")
    return meta
