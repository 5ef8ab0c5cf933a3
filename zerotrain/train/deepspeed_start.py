"""`zerotrain train --resume-from DEEPSPEED_CHECKPOINT`: continuing a run DeepSpeed trained.

Before any rank starts, `check_deepspeed_start` compares the checkpoint's trainable parameters
with the model the YAML builds (names, then shapes, then the optimizer's param groups) and the
step it is at with training.max_steps. Names that differ only by a wrapper's prefix (DDP-style
`module.`, torch.compile's `_orig_mod.`, a script's own wrapper module's `model.`) are renamed
on load (engine.load_checkpoint's strip_prefix). Each rank then `continue_deepspeed_run`s: the engine loads
the weights, Adam moments and counters (engine.load_checkpoint); the YAML's learning-rate schedule
is stepped to where DeepSpeed's stood (its own scheduler state is not taken: it may be another
class, e.g. the HF Trainer's LambdaLR); the data continues after global_samples samples of
zerotrain's own order (DeepSpeed's sampler order is not in the checkpoint).
"""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path
from typing import Any

from zerotrain.train.run_folder import ResumePoint, RunFolderError
from zerotrain.train.run_state import RunState

def deepspeed_names_and_shapes(tag_dir: Path) -> tuple[dict[str, tuple[int, ...]], int, dict]:
    """(trainable name -> shape, param group count, the model states file's counters) of a DeepSpeed
    tag folder, from its model states file alone (rank 0's at stage 3): no optimizer file is read."""
    from zerotrain.checkpoint.deepspeed_layout import MODEL_STATES
    from zerotrain.checkpoint.deepspeed_pickle import as_plain_data, load_deepspeed_file

    path = tag_dir / MODEL_STATES
    if not path.is_file():
        path = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = as_plain_data(load_deepspeed_file(path))
    groups = state.get("param_shapes")
    if groups:  # ZeRO 1-3: one {name: shape} per optimizer param group
        groups = groups if isinstance(groups, list) else [groups]
        shapes = {name: tuple(int(d) for d in shape) for group in groups for name, shape in group.items()}
        count = len(groups)
    else:  # stage 0: the module's parameters (buffers left out by name)
        buffers = set(state.get("buffer_names") or [])
        shapes = {n: tuple(t.shape) for n, t in (state.get("module") or {}).items() if n not in buffers}
        count = 0  # not recorded by name; the load checks it
    counters = {k: int(state.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}
    return shapes, count, counters


def name_prefix(ours: set[str], theirs: set[str]) -> str | None:
    """The prefix every checkpoint name has over this model's (e.g. "module."), when that is the
    whole difference; None otherwise."""
    sample = min(ours, default=None)
    for name in sorted(theirs):
        if sample is not None and name.endswith("." + sample):
            prefix = name[: -len(sample)]
            if {prefix + n for n in ours} == theirs:
                return prefix
    return None


def check_deepspeed_start(cfg: Any, point: ResumePoint, config_path: str | None) -> dict:
    """RunFolderError, naming what differs and what to do, unless the DeepSpeed checkpoint at `point`
    fits the model the YAML builds. Returns its counters."""
    from zerotrain.train.data import load_tokenizer
    from zerotrain.train.model import parameter_shapes

    tag_dir = point.deepspeed
    theirs, their_groups, counters = deepspeed_names_and_shapes(tag_dir)
    model = cfg.model
    ours = parameter_shapes(model, load_tokenizer(model.tokenizer, model.path, trust_remote_code=model.trust_remote_code))
    where = f"--resume-from {tag_dir}"
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    prefix = name_prefix(set(ours), set(theirs)) if missing or extra else None
    if prefix is not None:  # the DeepSpeed run's model was wrapped: each rank's load strips it
        print(f"{where}: every parameter name there starts with {prefix!r} (the DeepSpeed run's model was "
              "wrapped): read without it", flush=True)
        theirs = {name[len(prefix):]: shape for name, shape in theirs.items()}
    elif missing or extra:
        raise RunFolderError(
            f"{where} holds another model than the YAML's `model` section builds: "
            f"{len(missing)} of this model's parameters are not there (first: {missing[:1]}) and {len(extra)} of "
            f"its are not in this model (first: {extra[:1]}). Set the model section to the DeepSpeed run's model "
            "(its architecture and config_overrides, or model.path to its config)"
        )
    for name, shape in ours.items():
        if tuple(theirs[name]) != tuple(shape):
            raise RunFolderError(
                f"{where}: parameter {name!r} is {list(theirs[name])} there but {list(shape)} in the model the YAML "
                "builds; set the model section's sizes (config_overrides, or the tokenizer for the vocabulary) "
                "to the DeepSpeed run's"
            )
    groups = 2 if any(len(shape) < 2 for shape in ours.values()) else 1  # as model.decay_groups splits them
    if their_groups and their_groups != groups:
        raise RunFolderError(
            f"{where}: the DeepSpeed run's optimizer had {their_groups} param group(s), zerotrain train makes "
            f"{groups} (matrices with training.weight_decay, norms and biases without), and the optimizer state "
            "is kept per group. Start from its weights alone: `zerotrain consolidate "
            f"{shlex.quote(str(tag_dir.parent))} DIR --hf`, then model.path: DIR"
        )
    max_steps = cfg.training.max_steps
    if max_steps and max_steps <= counters["global_steps"]:
        again = f"zerotrain train {shlex.quote(config_path)}" if config_path else "zerotrain train"
        raise RunFolderError(
            f"{where}: the DeepSpeed run is at step {counters['global_steps']} and training.max_steps is {max_steps}: "
            f"nothing is left to train. Raise it, e.g. `{again} --resume-from {shlex.quote(str(point.load_dir))} "
            f"--training.max_steps {counters['global_steps'] + 100}`"
        )
    return counters


def continue_deepspeed_run(engine: Any, batches: Any, point: ResumePoint, seq_len: int) -> tuple[str, RunState]:
    """Loads the DeepSpeed checkpoint into `engine` and puts the schedule and `batches` where the
    DeepSpeed run stood. Returns (the tag folder loaded, the run state to continue from)."""
    ours = {name for flat in engine.flat_params for name in flat.names}  # trainable, as the loader names them
    theirs = set(deepspeed_names_and_shapes(point.deepspeed)[0])
    prefix = name_prefix(ours, theirs) if ours != theirs else None  # as check_deepspeed_start found it
    path, _client = engine.load_checkpoint(point.deepspeed, load_lr_scheduler_states=False, strip_prefix=prefix)
    steps, samples = int(engine.global_steps), int(engine.global_samples)
    if engine.lr_scheduler is not None:
        with warnings.catch_warnings():  # torch's "scheduler stepped before the optimizer" does not apply
            warnings.simplefilter("ignore")
            # As an uninterrupted run: one scheduler step per optimizer step DeepSpeed did not skip.
            for _ in range(steps - int(engine.skipped_steps)):
                engine.lr_scheduler.step()
    batches.skip_samples(samples)
    return str(path), RunState(step=steps, tokens=samples * seq_len, data=batches.state_dict())
