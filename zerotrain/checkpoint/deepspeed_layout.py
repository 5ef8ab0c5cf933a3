"""Checkpoints written by DeepSpeed itself: recognising the folder and rebuilding each parameter's fp32 master.

    SAVE_DIR/
      latest                                        text: the tag (global_stepN)
      TAG/
        mp_rank_00_model_states.pt                  stages 0-2: module, param_shapes, shared_params, ...
        zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: one per rank (frozen fragments, buffers)
        [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   stages 1-3: rank R's flat fp32 partitions

Where the masters are (read from DeepSpeed 0.19.8's engine, ZeRO optimizers and zero_to_fp32):
- stages 1-2: per param group, the ranks' `single_partition_of_fp32_groups` end to end are the group's
  parameters in `param_shapes` order, each followed by its `param_alignment_paddings` entry (absent
  before 0.17: no padding); what is left over is the group's alignment padding;
- stage 3: each rank's `fp32_flat_groups` (sub-groups) end to end hold, per parameter in `param_shapes`
  order, ceil(numel / world) elements; rank after rank, those pieces are the parameter plus padding;
- stage 0: fp32 training keeps no copy, the module's parameters are the masters; 16-bit training keeps
  `optimizer.fp32_groups` (per group, per parameter) without names: each is matched to the next module
  parameter, in module order, of its shape whose stored 16-bit value it rounds to.
Frozen parameters are `frozen_param_fragments` (stage 3: rank pieces end to end) or, where DeepSpeed
records none (stages 0-1), the module's value; buffers are the module's entries in `buffer_names`;
tied names (`shared_params`, or at stage 0 one storage under two names) are read under one name.
A universal tag folder (ds_to_universal.py output, deepspeed_universal.py) has the same model states
files and, instead of the optimizer files, each parameter's master and moments in a folder of its own.
Every .pt file goes through `load_deepspeed_file` (weights-only, DeepSpeed's classes as inert
stand-ins); DeepSpeed is never imported.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from pathlib import Path

import torch

from zerotrain.checkpoint.deepspeed_pickle import as_plain_data, load_deepspeed_file
from zerotrain.checkpoint.deepspeed_universal import LATEST_UNIVERSAL, UniversalFolder, is_universal_tag_dir
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.layout import LATEST, MASTER

MODEL_STATES = "mp_rank_00_model_states.pt"
_RANK_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
_RANK_OPTIM_STATES = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
# Written only by pipeline, tensor-parallel or MoE runs, whose pieces this reader does not join.
_UNSUPPORTED = {
    "layer_*-model_states.pt": "a pipeline-parallel checkpoint",
    "*mp_rank_01*": "a tensor-parallel checkpoint (several mp_rank files)",
    "*expert_*": "a mixture-of-experts checkpoint with expert files",
}


def is_deepspeed_tag_dir(path: Path) -> bool:
    """Whether `path` is one tag folder DeepSpeed wrote (it holds DeepSpeed's model states file)."""
    return (path / MODEL_STATES).is_file() or any(
        _RANK_MODEL_STATES.fullmatch(p.name) for p in path.glob("zero_pp_rank_*_model_states.pt")
    )


def find_deepspeed_tag_dir(checkpoint_dir: str | Path, tag: str | None, prefer_universal: bool = False) -> Path | None:
    """The DeepSpeed tag folder meant by CHECKPOINT_DIR [TAG], or None when it is not DeepSpeed's.

    CHECKPOINT_DIR is a save folder (TAG, or the tag its `latest` names, else its `latest_universal`:
    ds_to_universal.py writes only that) or a tag folder itself. `prefer_universal` (the config's
    checkpoint.load_universal) reads `latest_universal` first, as DeepSpeed does when a converted
    folder sits beside the original in one save folder.
    """
    from zerotrain.checkpoint.reader import read_latest  # the one reader of `latest`, which checks the name

    path = Path(checkpoint_dir)
    if not path.is_dir():
        return None
    if tag is None and is_deepspeed_tag_dir(path):
        return path
    if tag is None:
        order = (LATEST_UNIVERSAL, LATEST) if prefer_universal else (LATEST, LATEST_UNIVERSAL)
        latest = next((path / n for n in order if (path / n).is_file()), None)
        if latest is None:
            return None
        tag = read_latest(latest)
    candidate = path / str(tag)
    return candidate if candidate.is_dir() and is_deepspeed_tag_dir(candidate) else None


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


class DeepSpeedCheckpoint:
    """The fp32 masters, frozen parameters and buffers of one DeepSpeed tag folder.

    Reads like CheckpointReader does for consolidation: `params` (trainable, name -> {"shape"}),
    `module_entries` (frozen parameters and buffers, name -> {"shape", "dtype", "is_parameter"}),
    `read_param(MASTER, name)`, `read_module(name)`. The files are read whole when it opens (they
    are pickles: there is no reading a slice), so memory is about one copy of the masters.
    """

    def __init__(self, tag_dir: str | Path) -> None:
        self.tag_dir = Path(tag_dir)
        self._refuse_unsupported()
        model_files = self._model_state_files()
        states = [as_plain_data(load_deepspeed_file(f)) for f in model_files]
        self.model_state = states[0]
        # ds_to_universal.py output: the masters and moments per parameter, no optimizer files
        self.universal = UniversalFolder(self.tag_dir, self.model_state["param_shapes"]) if is_universal_tag_dir(
            self.tag_dir) else None
        optim_files = [] if self.universal else self._optim_files()
        optim = [as_plain_data(load_deepspeed_file(f))["optimizer_state_dict"] for f in optim_files]
        self._check_rank_files(optim, optim_files)
        if self.universal:  # rank 0's optimizer file less its partitions: the loss scaler and the like
            optim = [self.universal.optimizer_state]
        self.zero_stage = int(optim[0]["zero_stage"]) if optim else 0
        self.world_size = len(optim_files) if optim_files else int(self.model_state.get("dp_world_size") or 1)
        self.optim_states = optim  # each rank's optimizer_state_dict, for resuming (deepspeed_resume)
        self._masters: dict[str, torch.Tensor] = {}
        self._module: dict[str, torch.Tensor] = {}
        self.aliases = self._tied_names()  # a tied name -> the name it is read under
        # Which flat group (stages 1-2: param group; stage 3: sub-group) holds each parameter, and at
        # stage 0 the names in DeepSpeed's optimizer order: where its optimizer state is found.
        self.flat_group_of: dict[str, int] = {}
        self.optimizer_names: list[str] = []
        if self.universal:
            self._masters = self.universal.masters()
        elif self.zero_stage == 0:
            self._read_stage0()
        elif self.zero_stage <= 2:
            self._masters = self.split_flat([o["single_partition_of_fp32_groups"] for o in optim])
        else:
            self._masters = self.split_flat([o["fp32_flat_groups"] for o in optim])
        self._read_frozen_and_buffers(states)
        self.params = {n: {"shape": list(t.shape)} for n, t in self._masters.items()}
        buffers = set(self.model_state.get("buffer_names") or [])
        self.module_entries = {
            n: {"shape": list(t.shape), "dtype": str(t.dtype), "is_parameter": n not in buffers}
            for n, t in self._module.items()
        }
        self.meta = {"format": "deepspeed", "ds_version": self.model_state.get("ds_version"),
                     "zero_stage": self.zero_stage, "world_size": self.world_size, "hf_config": None}

    # --- the reader interface consolidation uses ---------------------------------------------

    def __enter__(self) -> "DeepSpeedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open: the files were read whole."""

    def read_param(self, kind: str, name: str) -> torch.Tensor:
        """Trainable parameter `name`'s fp32 master, in its shape (only `kind` "master" is read here)."""
        if kind != MASTER:
            raise CheckpointError(f"{self.tag_dir}: reading {kind!r} of a DeepSpeed checkpoint is not supported here")
        if name not in self._masters:
            raise CheckpointError(f"{self.tag_dir}: no trainable parameter {name!r} in this DeepSpeed checkpoint")
        return self._masters[name]

    def read_module(self, name: str) -> torch.Tensor:
        """A frozen parameter or buffer as DeepSpeed stored it."""
        if name not in self._module:
            raise CheckpointError(f"{self.tag_dir}: no frozen parameter or buffer {name!r} in this DeepSpeed checkpoint")
        return self._module[name]

    # --- files ---------------------------------------------------------------------------------

    def _refuse_unsupported(self) -> None:
        for pattern, what in _UNSUPPORTED.items():
            found = sorted(self.tag_dir.glob(pattern))
            if found:
                raise CheckpointError(
                    f"{self.tag_dir} is {what} ({found[0].name}); zerotrain reads DeepSpeed's data-parallel ZeRO "
                    "checkpoints only: convert it with DeepSpeed (ds_to_universal.py or zero_to_fp32.py) first"
                )

    def _ranked(self, pattern: re.Pattern, group: int) -> list[Path]:
        """Files matching `pattern`, in rank order, checked to be ranks 0..N-1 with none missing."""
        found = {int(m.group(group)): p for p in self.tag_dir.iterdir() if (m := pattern.fullmatch(p.name))}
        missing = [r for r in range(len(found)) if r not in found]
        if missing:
            raise CheckpointError(
                f"{self.tag_dir}: the file of rank {missing[0]} matching {pattern.pattern} is missing (found ranks "
                f"{sorted(found)}); copy the whole tag folder the DeepSpeed run wrote"
            )
        return [found[r] for r in sorted(found)]

    def _model_state_files(self) -> list[Path]:
        if (self.tag_dir / MODEL_STATES).is_file():
            return [self.tag_dir / MODEL_STATES]
        files = self._ranked(_RANK_MODEL_STATES, 1)
        if not files:
            raise CheckpointError(f"{self.tag_dir} holds no DeepSpeed model states file ({MODEL_STATES})")
        return files

    def _optim_files(self) -> list[Path]:
        return self._ranked(_RANK_OPTIM_STATES, 2)

    def _check_rank_files(self, optim: list[dict], files: list[Path]) -> None:
        if not optim:
            return
        count = optim[0]["partition_count"]
        count = max(count) if isinstance(count, list) else int(count)
        if count != len(files):
            raise CheckpointError(
                f"{self.tag_dir}: DeepSpeed saved this checkpoint on {count} ranks but {len(files)} optimizer "
                "files are there; copy the whole tag folder the DeepSpeed run wrote"
            )

    def _bad(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.tag_dir}: {problem}; the DeepSpeed files do not fit together (a mixed or "
                               "partly overwritten tag folder?)")

    # --- masters -------------------------------------------------------------------------------

    def split_flat(self, flats: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per rank, flat tensors laid out as that rank's fp32 partitions (stages 1-2: one per param group;
        stage 3: one per sub-group), cut into each trainable parameter's values, in its shape.

        The masters are read this way, and so are the optimizer's moments, which DeepSpeed keeps alike.
        """
        split = self._split_stage12 if self.zero_stage <= 2 else self._split_stage3
        return split(flats)

    def _split_stage12(self, partitions: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        shapes = self.model_state["param_shapes"]
        paddings = self.optim_states[0].get("param_alignment_paddings")
        out: dict[str, torch.Tensor] = {}
        for g, group_shapes in enumerate(shapes):
            flat = torch.cat([ranks[g] for ranks in partitions])
            group_paddings = paddings[g] if paddings is not None else [0] * len(group_shapes)
            if len(group_paddings) != len(group_shapes):
                raise self._bad(f"param group {g} has {len(group_shapes)} parameters but "
                                f"{len(group_paddings)} alignment paddings")
            offset = 0
            for (name, shape), pad in zip(group_shapes.items(), group_paddings):
                n = _numel(shape)
                if offset + n > flat.numel():
                    raise self._bad(f"param group {g} ends before {name!r}")
                out[name] = flat[offset : offset + n].view(*shape)
                self.flat_group_of[name] = g
                offset += n + int(pad)
            align = 2 * self.world_size  # what DeepSpeed pads each group to, at most
            if math.ceil(offset / align) != math.ceil(flat.numel() / align):
                raise self._bad(f"param group {g} holds {flat.numel()} elements, its parameters {offset}")
        return out

    def _split_stage3(self, sub_groups: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        world = len(sub_groups)
        flats = [torch.cat(groups) if groups else torch.empty(0) for groups in sub_groups]
        ends = list(itertools.accumulate(g.numel() for g in sub_groups[0]))  # where each sub-group ends
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in ((n, s) for group in self.model_state["param_shapes"] for n, s in group.items()):
            n = _numel(shape)
            part = math.ceil(n / world)
            if offset + part > flats[0].numel():
                raise self._bad(f"the flat fp32 groups end before {name!r}")
            out[name] = torch.cat([f[offset : offset + part] for f in flats])[:n].view(*shape)
            self.flat_group_of[name] = bisect.bisect_right(ends, offset)  # sub-groups hold whole parameters
            offset += part
        if offset != flats[0].numel():
            raise self._bad(f"each rank holds {flats[0].numel()} elements, its parameters {offset}")
        return out

    def _read_stage0(self) -> None:
        module = self.model_state["module"]
        optimizer = self.model_state.get("optimizer") or {}
        fp32_groups = optimizer.get("fp32_groups")
        buffers = set(self.model_state.get("buffer_names") or [])
        free = [n for n in module if n not in buffers and n not in self.aliases]
        if fp32_groups is None:  # fp32 training: the module holds the masters (its parameters are trained)
            self._name_stage0_fp32_state(optimizer, free)
            return
        for g, group in enumerate(fp32_groups):
            cursor = 0
            for master in group:
                while cursor < len(free) and not _rounds_to(master, module[free[cursor]]):
                    cursor += 1
                if cursor == len(free):
                    raise self._bad(f"a {list(master.shape)} master of param group {g} matches no module parameter "
                                    "(16-bit ZeRO stage 0 records no names: it is matched by shape and value)")
                self.optimizer_names.append(free[cursor])
                self._masters[free.pop(cursor)] = master

    def _name_stage0_fp32_state(self, optimizer: dict, free: list[str]) -> None:
        """fp32 stage 0 saves torch's optimizer state dict, numbered without names: each entry takes the
        next module parameter, in module order, of its moments' shape (a frozen one of that shape first
        in the module would be mistaken; DeepSpeed records nothing that tells them apart)."""
        state = optimizer.get("state") or {}
        for group in optimizer.get("param_groups") or []:
            for index in group.get("params", []):
                moments = [v for v in state.get(index, {}).values() if torch.is_tensor(v) and v.dim()]
                shape = moments[0].shape if moments else None
                found = next((n for n in free if shape is None or self.model_state["module"][n].shape == shape), None)
                if found is None:
                    raise self._bad(f"optimizer state {index} (shape {list(shape or [])}) matches no module parameter")
                self.optimizer_names.append(found)
                free.remove(found)

    # --- frozen parameters, buffers, tied names -------------------------------------------------

    def _tied_names(self) -> dict[str, str]:
        aliases = dict(self.model_state.get("shared_params") or {})
        if self.zero_stage == 0:  # no shared_params: one storage under two names is a tied parameter
            seen: dict[int, str] = {}
            for name, tensor in self.model_state["module"].items():
                key = tensor.untyped_storage().data_ptr()
                if key in seen and tensor.numel():
                    aliases[name] = seen[key]
                seen.setdefault(key, name)
        return aliases

    def _read_frozen_and_buffers(self, states: list[dict]) -> None:
        module = self.model_state["module"]
        buffers = self.model_state.get("buffer_names") or []
        fragments = self.model_state.get("frozen_param_fragments")
        if fragments:
            for name, shape in self.model_state["frozen_param_shapes"].items():
                pieces = [s["frozen_param_fragments"][name].reshape(-1) for s in states]
                self._module[name] = torch.cat(pieces)[: _numel(shape)].view(*shape)
        elif self.zero_stage <= 2:  # stages 0-1 record no frozen parameters: the module's value is theirs
            # fp32 stage 0 keeps no masters: its module parameters are them (frozen ones not told apart)
            into = self._masters if self.zero_stage == 0 and not self._masters else self._module
            for name, tensor in module.items():
                if name not in self._masters and name not in self.aliases and name not in buffers:
                    into[name] = tensor
        for name in buffers:
            self._module[name] = module[name]


def _rounds_to(master: torch.Tensor, stored: torch.Tensor) -> bool:
    return master.shape == stored.shape and torch.equal(master.to(stored.dtype), stored)
