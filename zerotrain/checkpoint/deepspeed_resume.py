"""Resuming a run DeepSpeed saved: its tag folder read as loader.py reads zerotrain's own checkpoints.

`DeepSpeedResumeReader` presents a DeepSpeed tag folder through the reader interface the loader's
restore steps use (params, module_entries, kinds, read_range, read_module, meta), so the same steps
fill the engine's shards at any world size and stage. What DeepSpeed keeps where (0.19.8):
- masters and moments: stages 1-2 hold each rank's flat fp32 partition per param group and, in
  `base_optimizer_state`, torch's optimizer state of that flat partition (same layout); stage 3 the
  same per sub-group (`fp32_flat_groups`, `optimizer_state_dict`; `param_shapes` per sub-group there),
  or, saved with `elastic_checkpoint` (read as 0.15.4 writes it), a list of each group's state in
  that layout; stage 0 torch's state dict per
  parameter, numbered in optimizer order (deepspeed_layout names them);
- the step and other scalars per (sub-)group; the LR scheduler, global_steps, global_samples and
  skipped_steps in the model states file; the fp16 loss scaler in the optimizer files (stage 0: the
  FP16 optimizer's own keys). DeepSpeed saves no RNG state, so none is restored.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerotrain.checkpoint.deepspeed_layout import DeepSpeedCheckpoint
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.layout import MASTER

# What DeepSpeed's engine keeps out of the client state it returns (engine._load_checkpoint, 0.19.8);
# the optimizer and scheduler entries only when it loads them.
_DEEPSPEED_KEYS = ("module", "sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size",
                   "mp_world_size", "data_sampler", "random_ltd")
_SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class DeepSpeedResumeReader:
    """A DeepSpeed tag folder as the loader reads a checkpoint: whole tensors per name, any range of them.

    `state` stands for zerotrain's state file: the LR scheduler's state and the client state, which
    is, as DeepSpeed returns it, every other top-level entry of the model states file (the optimizer's
    and the scheduler's too when they are not loaded). The masters are DeepSpeed's fp32 copies, also
    with load_module_only (where DeepSpeed would take the 16-bit module's values). `strip_prefix`
    (e.g. "module.", "_orig_mod.") is cut from every name: the run saved a wrapped model.
    """

    def __init__(self, tag_dir: Path, engine, load_optimizer_states: bool = True,
                 load_lr_scheduler_states: bool = True, strip_prefix: str | None = None) -> None:
        checkpoint = DeepSpeedCheckpoint(tag_dir)
        self.tag_dir = Path(tag_dir)
        self.model_state = checkpoint.model_state
        self.model_file = next(iter(sorted(self.tag_dir.glob("*model_states.pt"))), self.tag_dir)
        kept = set(_DEEPSPEED_KEYS) | ({"optimizer"} if load_optimizer_states else set())
        kept |= {"lr_scheduler"} if load_lr_scheduler_states else set()
        self.state = {"lr_scheduler": self.model_state.get("lr_scheduler"),
                      "client_state": {k: v for k, v in self.model_state.items() if k not in kept}}
        self.params = checkpoint.params
        self.module_entries = checkpoint.module_entries
        self._module = checkpoint.read_module
        self._values: dict[str, dict[str, torch.Tensor]] = {
            MASTER: {name: checkpoint.read_param(MASTER, name) for name in checkpoint.params}
        }
        groups, per_name_scalars, group_names = self._optimizer_state(checkpoint)
        self.kinds = list(self._values)
        self.meta = {
            "world_size": checkpoint.world_size,
            "param_groups": [_as_json_like({k: v for k, v in g.items() if k != "params"}) for g in groups],
            "group_scalars": [self._group_scalars(names, per_name_scalars) for names in group_names],
            "counters": self._counters(engine),
            "loss_scaler": self._loss_scaler(checkpoint, engine),
        }
        if strip_prefix:
            self._strip(strip_prefix)

    # --- the reader interface loader.py uses ------------------------------------------------------

    def __enter__(self) -> "DeepSpeedResumeReader":
        return self

    def __exit__(self, *exc) -> None:
        """Nothing stays open: the files were read whole."""

    def numel(self, name: str) -> int:
        """Elements of trainable parameter `name`."""
        return self._values[MASTER][name].numel()

    def read_range(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of `name`'s `kind` (master or a moment), as fp32; zeros where DeepSpeed
        kept no state for it (a parameter its optimizer never stepped)."""
        if name not in self.params:
            raise CheckpointError(f"{self.tag_dir}: no trainable parameter {name!r} in this DeepSpeed checkpoint")
        stored = self._values.get(kind, {}).get(name)
        if stored is None:
            return torch.zeros(end - start, dtype=torch.float32)
        return stored.reshape(-1)[start:end].float()

    def read_module(self, name: str) -> torch.Tensor:
        """A frozen parameter or buffer as DeepSpeed stored it."""
        return self._module(name)

    def corrupt(self, problem: str) -> CheckpointError:
        """The error for a DeepSpeed file whose content cannot be restored."""
        return CheckpointError(f"{problem} (a DeepSpeed checkpoint: copy the whole tag folder the run wrote)")

    def _strip(self, prefix: str) -> None:
        """Names as the unwrapped model has them: `prefix` (a wrapper's, e.g. "module.") cut from every
        parameter and module entry; each must carry it, or the wrapper held more than the model."""
        names = sorted(set(self.params) | set(self.module_entries))
        stray = [n for n in names if not n.startswith(prefix)]
        if stray:
            raise CheckpointError(
                f"{self.tag_dir}: strip_prefix={prefix!r}, but {len(stray)} of its {len(names)} names do not start "
                f"with it (first: {stray[0]!r}): pass the prefix every name there has, or none"
            )
        cut = len(prefix)
        self.params = {n[cut:]: v for n, v in self.params.items()}
        self.module_entries = {n[cut:]: v for n, v in self.module_entries.items()}
        self._values = {kind: {n[cut:]: t for n, t in named.items()} for kind, named in self._values.items()}
        read_module = self._module
        self._module = lambda name: read_module(prefix + name)

    # --- DeepSpeed's optimizer state, per parameter -------------------------------------------------

    def _optimizer_state(self, checkpoint: DeepSpeedCheckpoint) -> tuple[list[dict], dict, list[list[str]]]:
        """Fills the moments into self._values; returns the param groups, each name's scalar state
        (step, ...) and each param group's names."""
        stage = checkpoint.zero_stage
        if checkpoint.universal:  # ds_to_universal.py output: each parameter's moments and step on their own
            moments, groups, entries, group_names = checkpoint.universal.optimizer()
            self._values.update(moments)
            return groups, {n: _scalars(e) for n, e in entries.items()}, group_names
        if stage == 0:
            optimizer = self.model_state.get("optimizer") or {}
            base = optimizer.get("optimizer_state_dict", optimizer)  # 16-bit wraps torch's state dict
            self._check_base(base, self.model_file)
            names = checkpoint.optimizer_names
            per_name = {names[i]: entry for i, entry in enumerate(base["state"][k] for k in sorted(base["state"]))}
            for name, entry in per_name.items():
                for kind, value in entry.items():
                    if torch.is_tensor(value) and value.dim():
                        self._values.setdefault(kind, {})[name] = value
            group_names = [[names[i] for i in g["params"]] for g in base["param_groups"]]
            return base["param_groups"], {n: _scalars(e) for n, e in per_name.items()}, group_names
        key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
        bases = [o.get(key) for o in checkpoint.optim_states]
        if stage <= 2 and all(isinstance(base, list) for base in bases):
            return self._elastic_optimizer_state(checkpoint, bases)
        for base in bases:
            self._check_base(base, self.tag_dir)
        states = [[b["state"][i] for i in sorted(b["state"])] for b in bases]
        kinds = [k for k, v in states[0][0].items() if torch.is_tensor(v) and v.dim()] if states[0] else []
        for kind in kinds:
            self._values[kind] = checkpoint.split_flat([[entry[kind] for entry in rank] for rank in states])
        per_name = {name: _scalars(states[0][group]) for name, group in checkpoint.flat_group_of.items()}
        # Each torch param group lists its flat groups: stages 1-2 one, stage 3 its sub-groups, whose
        # parameters param_shapes gives per sub-group.
        shapes = self.model_state["param_shapes"]
        group_names = [[n for flat in g["params"] for n in shapes[flat]] for g in bases[0]["param_groups"]]
        return bases[0]["param_groups"], per_name, group_names

    def _elastic_optimizer_state(self, checkpoint: DeepSpeedCheckpoint,
                                 bases: list[list]) -> tuple[list[dict], dict, list[list[str]]]:
        """`elastic_checkpoint` (stages 1-2): each rank's `base_optimizer_state` is a list, per param group,
        of that group's state (moments laid out as its flat fp32 partition, padding cut alike) without
        torch's param_groups: DeepSpeed restores only the step (`base_optimizer_state_step` when the
        state holds none), so this engine's hyperparameters stay."""
        group_names = [list(shapes) for shapes in self.model_state["param_shapes"]]
        if any(len(base) != len(group_names) or not all(isinstance(g, dict) for g in base) for base in bases):
            raise CheckpointError(
                f"{self.tag_dir}: base_optimizer_state holds {len(bases[0])} entries for {len(group_names)} param "
                "groups; pass load_optimizer_states=False to resume the weights only"
            )
        kinds = [k for k, v in bases[0][0].items() if torch.is_tensor(v) and v.dim()]
        for kind in kinds:
            self._values[kind] = checkpoint.split_flat([[group[kind] for group in base] for base in bases])
        saved_step = checkpoint.optim_states[0].get("base_optimizer_state_step")
        per_group = []
        for state in bases[0]:
            scalars = _scalars(state)
            step = scalars.pop("step", {}).get("value", saved_step)
            if step is not None:  # torch's Adam keeps a float32 tensor, DeepSpeed's own an int
                scalars["step"] = {"value": float(step), "dtype": "float32"}
            per_group.append(scalars)
        per_name = {name: per_group[group] for name, group in checkpoint.flat_group_of.items()}
        return [{} for _ in group_names], per_name, group_names

    def _check_base(self, base: object, where: Path) -> None:
        ok = isinstance(base, dict) and isinstance(base.get("state"), dict) and isinstance(base.get("param_groups"), list)
        if not ok:
            raise CheckpointError(
                f"{where}: the optimizer state is neither torch's state dict (state, param_groups) nor, from an "
                "elastic_checkpoint run, a list per param group; this layout is not read: pass "
                "load_optimizer_states=False to resume the weights only"
            )

    def _group_scalars(self, names: list[str], per_name: dict[str, dict]) -> dict:
        present = [per_name[n] for n in names if n in per_name]
        if any(s != present[0] for s in present):
            raise CheckpointError(
                f"{self.tag_dir}: the parameters {names[:5]} of one param group have different optimizer steps "
                "in DeepSpeed's files; zerotrain keeps one per group: pass load_optimizer_states=False"
            )
        return present[0] if present else {}

    # --- counters and loss scale --------------------------------------------------------------------

    def _counters(self, engine) -> dict:
        state = self.model_state
        steps = int(state.get("global_steps") or 0)
        samples = state.get("global_samples")
        return {
            "global_steps": steps,
            # DeepSpeed saves no micro step count: a boundary every accumulation's worth of micro steps.
            "micro_steps": steps * engine.gradient_accumulation_steps(),
            "skipped_steps": int(state.get("skipped_steps") or 0),
            "global_samples": int(samples) if samples is not None else steps * engine.train_batch_size(),
        }

    def _loss_scaler(self, checkpoint: DeepSpeedCheckpoint, engine) -> dict | None:
        if engine.loss_scaler is None:
            return None
        if checkpoint.zero_stage == 0:  # the FP16 optimizer keeps the scaler's values as its own keys
            saved = self.model_state.get("optimizer") or {}
        else:
            saved = checkpoint.optim_states[0].get("loss_scaler") or {}
        # Keys DeepSpeed did not save (stage 0 has no hysteresis count) keep this engine's values.
        state = dict(engine.loss_scaler.state_dict())
        state.update({k: saved[k] for k in _SCALER_KEYS if k in saved and k in state})
        return state


def _scalars(entry: dict) -> dict:
    """An optimizer state entry's scalar values in the loader's form: {key: {"value", "dtype"}}."""
    out = {}
    for key, value in entry.items():
        if torch.is_tensor(value) and value.dim() == 0:
            out[key] = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
        elif not torch.is_tensor(value):
            out[key] = {"value": value, "dtype": None}
    return out


def _as_json_like(value: object) -> object:
    """Tuples as lists, as the loader reads param_groups from JSON (betas)."""
    if isinstance(value, dict):
        return {k: _as_json_like(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json_like(v) for v in value]
    return value
