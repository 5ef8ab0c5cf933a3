"""DeepSpeed's universal checkpoints (what its `ds_to_universal.py` writes): one folder per parameter.

    SAVE_DIR/
      latest_universal                          text: the tag (the converter writes no `latest`)
      TAG/                                      e.g. global_step3_universal
        mp_rank_00_model_states.pt              stages 1-2 (stage 3: zero_pp_rank_R_..._model_states.pt),
                                                copies of the source checkpoint's
        zero/optimizer_state.pt                 rank 0's optimizer file less its flat partitions, with
                                                `param_groups` (torch's, less their states) on top
        zero/<name>/fp32.pt, exp_avg.pt, ...    each parameter's whole master and moments
        zero/<name>/step.pt                     stages 1-2 only: the parameter's optimizer step

Read from DeepSpeed 0.19.8's converter and its loaders (`universal_checkpoint.load_hp_checkpoint_state`,
stage 3's `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): stages 1-2 store `{"param": tensor,
"cat_dim": ...}` in the parameter's shape, stage 3 the bare flat tensor; stage 3 keeps the step in
optimizer_state.pt's `optimizer_state_dict` (per sub-group, as in its optimizer files). The trainable
parameters are the model states' `param_shapes`: the converter also writes fp32.pt for frozen ones,
buffers and tied aliases, which are read from the model states as in a plain DeepSpeed checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerotrain.checkpoint.deepspeed_pickle import as_plain_data, load_deepspeed_file
from zerotrain.checkpoint.errors import CheckpointError

LATEST_UNIVERSAL = "latest_universal"
OPTIMIZER_STATE = Path("zero") / "optimizer_state.pt"
_NOT_MOMENTS = ("fp32", "step")  # the master and the step: every other file in a parameter's folder is a moment


def is_universal_tag_dir(path: Path) -> bool:
    """Whether tag folder `path` is DeepSpeed's universal format (it holds zero/optimizer_state.pt)."""
    return (path / OPTIMIZER_STATE).is_file()


class UniversalFolder:
    """The per-parameter files of one universal tag folder, read through the DeepSpeed allow-list.

    `param_shapes` is the model states' entry: per flat group (stages 1-2: param group; stage 3:
    sub-group), each trainable parameter's name and shape.
    """

    def __init__(self, tag_dir: Path, param_shapes: list[dict]) -> None:
        self.tag_dir = Path(tag_dir)
        self.optimizer_state = as_plain_data(load_deepspeed_file(self.tag_dir / OPTIMIZER_STATE))
        self.zero_stage = int(self.optimizer_state.get("zero_stage") or 0)
        self.param_shapes = param_shapes
        self.group_of = {name: g for g, shapes in enumerate(param_shapes) for name in shapes}

    def _read(self, name: str, kind: str) -> torch.Tensor:
        path = self.tag_dir / "zero" / name / f"{kind}.pt"
        loaded = load_deepspeed_file(path, bare_tensor=True)
        tensor = loaded.get("param") if isinstance(loaded, dict) else loaded
        shape = self.param_shapes[self.group_of[name]][name]
        if not torch.is_tensor(tensor) or tensor.numel() != torch.Size(shape).numel():
            raise CheckpointError(f"{path} does not hold {name!r}'s {list(shape)} values; copy the whole universal "
                                  "folder ds_to_universal.py wrote")
        return tensor.detach().reshape(shape)  # stage 3 saves the master still requiring grad

    def masters(self) -> dict[str, torch.Tensor]:
        """Each trainable parameter's fp32 master, in its shape."""
        return {name: self._read(name, "fp32") for name in self.group_of}

    def optimizer(self) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict], dict[str, dict], list[list[str]]]:
        """(moments: kind -> name -> tensor, torch's param groups, each name's scalar optimizer state as
        torch keeps it (the step), each param group's names)."""
        moments: dict[str, dict[str, torch.Tensor]] = {}
        scalars: dict[str, dict] = {}
        sub_group_states = (self.optimizer_state.get("optimizer_state_dict") or {}).get("state") or {}
        for name, group in self.group_of.items():
            folder = self.tag_dir / "zero" / name
            for kind in sorted(p.stem for p in folder.glob("*.pt") if p.stem not in _NOT_MOMENTS):
                moments.setdefault(kind, {})[name] = self._read(name, kind)
            if (folder / "step.pt").is_file():
                scalars[name] = {"step": load_deepspeed_file(folder / "step.pt", bare_tensor=True)}
            elif group in sub_group_states:  # stage 3: the sub-group's step, as its optimizer files keep it
                scalars[name] = {k: v for k, v in sub_group_states[group].items()
                                 if not (torch.is_tensor(v) and v.dim())}
            else:
                raise CheckpointError(f"{folder}: no step.pt and no optimizer step for {name!r} in {OPTIMIZER_STATE}; "
                                      "pass load_optimizer_states=False to resume the weights only")
        groups = self.optimizer_state.get("param_groups")
        if not isinstance(groups, list):
            raise CheckpointError(f"{self.tag_dir / OPTIMIZER_STATE} holds no param_groups; pass "
                                  "load_optimizer_states=False to resume the weights only")
        group_names = [[n for flat in g["params"] for n in self.param_shapes[flat]] for g in groups]
        return moments, groups, scalars, group_names
