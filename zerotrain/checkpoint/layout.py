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

A checkpoint may come from anywhere, so everything read from it is checked before use
(:func:`read_meta`, :func:`tag_name_problem`): a tag or file name is one plain name inside
the checkpoint folder, and every size meta.json claims is a whole number that the slices
listed add up to, so no claim leads outside the folder or into a huge allocation.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

FORMAT = "zerotrain-checkpoint/1"
META = "meta.json"
STATE = "state.pt"
LATEST = "latest"
MASTER = "master"
MODULE = "module"


_SHARD_FILE = re.compile(r"shards_rank(\d{5,9})\.safetensors")
_COUNTERS = ("global_steps", "micro_steps", "skipped_steps", "global_samples")
# Element counts and offsets past this are no real tensor's (and overflow torch's int64 sizes).
_MAX_ELEMENTS = 2**62
# Tag names past this are no file name (NAME_MAX on Linux).
_MAX_TAG_BYTES = 255


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


def tag_name_problem(tag: object) -> str | None:
    """Why `tag` cannot name a tag folder directly inside a checkpoint folder (``None`` when it can)."""
    if not isinstance(tag, str) or not tag:
        return "it is empty"
    if "\0" in tag:
        return "it holds a NUL character"
    if "\n" in tag or "\r" in tag:
        return "it spans more than one line"
    if not tag.isprintable():
        return "it holds control characters"
    if any(sep and sep in tag for sep in (os.sep, os.altsep, "/")):
        return "it is a path, not a folder name (it holds '/')"
    if tag.startswith("."):
        return "it starts with '.' (names saves in progress or parked copies, or the folder above)"
    if len(tag.encode("utf-8", "surrogateescape")) > _MAX_TAG_BYTES:
        return f"it is longer than the {_MAX_TAG_BYTES} bytes a folder name may have"
    return None


def read_meta(tag_dir: Path) -> dict:
    """Loads and checks meta.json; errors name the file and say what is wrong.

    A meta.json that is there but garbled or inconsistent raises a CheckpointError whose
    ``__cause__`` is a ValueError (the reader then points at the previous intact tag).
    """
    from zerotrain.checkpoint.errors import CheckpointError

    path = tag_dir / META
    if not path.is_file():
        raise CheckpointError(f"{tag_dir} is not a zerotrain checkpoint: {META} is missing")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = "it is nested too deeply" if isinstance(e, RecursionError) else e
        raise CheckpointError(f"{path} is corrupt: {problem}") from ValueError(str(problem))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    if not isinstance(meta, dict):
        problem = f"it holds a JSON {type(meta).__name__}, not an object with the checkpoint's description"
        raise CheckpointError(f"{path} is corrupt: {problem}") from ValueError(problem)
    fmt = meta.get("format")
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {fmt!r} (this zerotrain reads {FORMAT!r})")
    try:
        check_meta(meta)
    except ValueError as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from e
    return meta


def check_meta(meta: dict) -> None:
    """Raises ValueError naming the first field of `meta` (a parsed meta.json) that is missing or wrong."""
    world_size = _whole(meta, "world_size", "world_size", low=1)
    if not isinstance(meta.get("tag", ""), str):
        raise ValueError(f"`tag` is {_kind(meta['tag'])}, not a string")
    counters = _field(meta, "counters", dict, "counters")
    for name in _COUNTERS:
        _whole(counters, name, f"counters.{name}")
    numels: dict[str, int] = {}
    for name, info in _field(meta, "params", dict, "params").items():
        where = f"params[{name!r:.120}]"
        numels[name] = _shape_numel(_field(_object(info, where), "shape", list, f"{where}.shape"), f"{where}.shape")
    for name, info in _field(meta, "module", dict, "module").items():
        where = f"module[{name!r:.120}]"
        _shape_numel(_field(_object(info, where), "shape", list, f"{where}.shape"), f"{where}.shape")
        _field(info, "dtype", str, f"{where}.dtype")
        if not isinstance(info.get("is_parameter", False), bool):
            _not(f"{where}.is_parameter", info["is_parameter"], "true or false")
    kinds = _field(meta, "kinds", list, "kinds")
    if MASTER not in kinds or not all(isinstance(k, str) and k for k in kinds):
        raise ValueError(f"`kinds` must list the names of the stored states, {MASTER!r} among them; "
                         f"it is {kinds!r:.80}")
    _check_files(_field(meta, "files", dict, "files"), numels, world_size)
    for key, kind in (("hf_config", dict), ("loss_scaler", dict), ("param_groups", list), ("group_scalars", list)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            _not(key, meta[key], "an object" if kind is dict else "a list")


def _check_files(files: dict, numels: dict[str, int], world_size: int) -> None:
    """Every shard file is a plain shard name of a rank below `world_size`, and its slices tile each parameter."""
    ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in numels}
    for file, entries in files.items():
        match = _SHARD_FILE.fullmatch(file)
        if not match:
            raise ValueError(
                f"it names the shard file {file!r:.120}, which is not a shard file name such as {shard_file(0)!r} "
                "(a path or another file is never read)"
            )
        if int(match.group(1)) >= world_size:
            raise ValueError(f"it lists {file} of a rank past its world_size of {world_size}")
        if not isinstance(entries, list):
            _not(f"files[{file!r:.120}]", entries, "a list of [NAME, START, NUMEL]")
        for entry in entries:
            where = f"an entry of files[{file!r:.120}]"
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
                _not(where, entry, "[NAME, START, NUMEL]")
            name, start, numel = entry
            if name not in numels:
                raise ValueError(f"{where} is a slice of {name!r:.120}, which `params` does not list")
            start = _whole({"start": start}, "start", f"the start of {where}")
            numel = _whole({"numel": numel}, "numel", f"the size of {where}", low=1)
            ranges[name].append((start, start + numel))
    for name, spans in ranges.items():
        reached = 0
        for start, end in sorted(spans):
            if start != reached:
                what = "overlap" if start < reached else f"leave elements [{reached}, {start}) out"
                raise ValueError(f"the slices of {name!r:.120} listed in `files` {what}")
            reached = end
        if reached != numels[name]:
            raise ValueError(
                f"the slices of {name!r:.120} listed in `files` hold {reached} elements, but its shape in `params` "
                f"has {numels[name]}"
            )


def _shape_numel(shape: list, where: str) -> int:
    numel = 1
    for size in shape:
        numel *= _whole({"size": size}, "size", f"a size in {where}")
        if numel > _MAX_ELEMENTS:
            raise ValueError(f"{where} claims more than 2**62 elements, more than any tensor has")
    return numel


def _field(container: dict, key: str, kind: type, where: str):
    if key not in container:
        raise ValueError(f"{where} is missing")
    if not isinstance(container[key], kind):
        _not(where, container[key], {dict: "an object", list: "a list", str: "a string"}[kind])
    return container[key]


def _whole(container: dict, key: str, where: str, low: int = 0) -> int:
    """container[key], checked to be an integer in [low, 2**62]."""
    if key not in container:
        raise ValueError(f"{where} is missing")
    value = container[key]
    if isinstance(value, bool) or not isinstance(value, int):
        _not(where, value, "a whole number")
    if value < low:
        raise ValueError(f"{where} is {value:.6g}, less than {low}")
    if value > _MAX_ELEMENTS:
        raise ValueError(f"{where} is {value:.6g}, more than 2**62: no tensor is that large")
    return value


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        _not(where, value, "an object")
    return value


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def _not(where: str, value: object, wanted: str):
    raise ValueError(f"{where} is {_kind(value)}, not {wanted}")
