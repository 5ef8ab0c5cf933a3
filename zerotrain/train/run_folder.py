"""The rules that keep a run directory's work from being lost.

- A folder that already holds a run (checkpoints or metrics) is not trained into again
  unless the user says `--resume` (continue it) or `--overwrite` (start again; the old
  run's files are removed first). A silent re-run used to overwrite it.
- A folder with a live run (train.pid names a live process) is never touched by another.
- `training.resume` (`--resume-from`) names a checkpoints folder (one with `latest`) or one tag
  folder in it, zerotrain's or DeepSpeed's; anything else is an error before any step, never a
  silent start from step 0.
- Pruning (`output.keep_checkpoints`) removes only tags this run wrote, oldest first,
  and never the tag `latest` names.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from zerotrain.checkpoint.layout import LATEST, META
from zerotrain.config.errors import ConfigError
from zerotrain.system.durable_files import is_temp_of
from zerotrain.train.run_control import running_pid

CHECKPOINTS = "checkpoints"
# What a run leaves in its directory; --overwrite removes exactly these (config.yaml is rewritten).
RUN_OUTPUTS = ("checkpoints", "metrics.csv", "eval.csv", "summary.json", "hf", "tensorboard", "STOP")


class RunFolderError(ConfigError):
    """The run directory is not in a state this request may touch; the message says what to do."""


def holds_a_run(run_dir: Path) -> bool:
    """True if `run_dir` has the checkpoints or metrics of an earlier run."""
    checkpoints = run_dir / CHECKPOINTS
    has_tags = checkpoints.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in checkpoints.iterdir())
    return has_tags or (checkpoints / LATEST).exists() or (run_dir / "metrics.csv").exists()


def first_missing_folder(run_dir: Path) -> Path | None:
    """The outermost folder on the way to `run_dir` that does not exist yet (None: it exists)."""
    if run_dir.exists():
        return None
    top = run_dir.absolute()
    while not top.parent.exists():
        top = top.parent
    return top


def discard_unstarted_run(run_dir: Path, made: Path) -> bool:
    """Removes `run_dir` and the empty folders this launch made for it (`made`, from
    `first_missing_folder`) when its ranks failed before training wrote anything: a config
    error the ranks found leaves nothing behind. Returns whether it did."""
    if not run_dir.is_dir() or holds_a_run(run_dir) or any(p.is_dir() for p in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = run_dir.absolute().parent
    while folder != made.parent and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    return True


def check_no_live_run(run_dir: Path, own_pid: int | None = None) -> None:
    """Refuses when another live process is running in `run_dir`."""
    pid = running_pid(run_dir)
    if pid is not None and pid != own_pid:
        raise RunFolderError(
            f"a run is already active in {run_dir} (pid {pid}); stop it first with `zerotrain stop {shlex.quote(str(run_dir))}`, "
            f"follow it with `zerotrain logs {shlex.quote(str(run_dir))} -f`, or set another --output.dir"
        )


def check_can_start(run_dir: Path, resume: str, overwrite: bool, config_path: str | None) -> None:
    """Refuses to start a fresh run on top of an earlier one unless asked to resume or overwrite."""
    if overwrite and resume != "never":
        raise RunFolderError("--overwrite starts the run again from step 0, --resume continues it: choose one")
    if resume == "never" and not overwrite and holds_a_run(run_dir):
        again = f"zerotrain train {shlex.quote(str(config_path))}" if config_path else "zerotrain train"
        raise RunFolderError(
            f"{run_dir} already holds a run (checkpoints or metrics.csv); training into it again would overwrite "
            f"them. Continue it with `{again} --resume`, start it again with `{again} --overwrite` (deletes its "
            "checkpoints and metrics), or set another --output.dir"
        )


def require_checkpoint_to_resume(run_dir: Path, config_path: str | None) -> None:
    """`--resume` continues a run: with no checkpoint to continue from, it is an error, not step 0.

    `training.resume: auto` in the YAML keeps "continue if there is one" (a requeued job's form).
    """
    load_dir = run_dir / CHECKPOINTS
    if newest_complete_checkpoint(load_dir) is not None:
        return
    again = f"zerotrain train {shlex.quote(str(config_path))}" if config_path else "zerotrain train"
    found = "does not exist" if not load_dir.exists() else f"has no `{LATEST}` file (no checkpoint was completed)"
    raise RunFolderError(
        f"--resume: nothing to resume: {load_dir} {found}. Start the run with `{again}` (no --resume); "
        "check output.dir if the run is elsewhere; or set training.resume: auto to continue when a "
        "checkpoint exists and start from step 0 when none does"
    )


def clear_previous_run(run_dir: Path) -> list[str]:
    """Removes an earlier run's outputs (for --overwrite); returns what was removed."""
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


@dataclass(frozen=True)
class ResumePoint:
    """Where to load from: the checkpoints folder and, when one was named, the tag in it.
    `deepspeed`: the tag folder DeepSpeed wrote, when the checkpoint is a DeepSpeed run's."""

    load_dir: Path
    tag: str | None = None
    deepspeed: Path | None = None


def is_checkpoint_tag(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file()


def resolve_resume(resume: str, run_dir: Path) -> ResumePoint | None:
    """What `training.resume` asks for, checked before anything starts.

    "never": None. "auto" (`--resume`): the run's newest checkpoint, or None when the
    run has none yet. A path: a checkpoints folder with `latest`, or one tag folder.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return newest_complete_checkpoint(run_dir / CHECKPOINTS)
    path = Path(resume).expanduser()
    if is_checkpoint_tag(path):
        return ResumePoint(path.parent, path.name)
    deepspeed = _deepspeed_tag_dir(path)
    if deepspeed is not None:
        return ResumePoint(path, None, deepspeed)
    if (path / LATEST).is_file():
        return ResumePoint(path)
    if not path.exists():
        problem = "does not exist"
    elif not path.is_dir():
        problem = "is a file, not a folder"
    else:
        tags = sorted(p.name for p in path.iterdir() if is_checkpoint_tag(p) or _deepspeed_tag_dir(p))
        problem = (
            f"has no `latest` file; it holds the tags {', '.join(tags)}: name one of them, e.g. {path / tags[-1]}"
            if tags else f"is a zerotrain run folder: give its checkpoints folder, {path / CHECKPOINTS}"
            if (path / CHECKPOINTS).is_dir() else
            f"is neither a checkpoints folder (no `{LATEST}` file) nor a checkpoint tag (no {META}, and no "
            "DeepSpeed model states file)"
        )
    raise RunFolderError(
        f"training.resume (--resume-from): {path} {problem}. Give a checkpoints folder (e.g. {run_dir / CHECKPOINTS}) or one tag "
        f"folder in it (e.g. {run_dir / CHECKPOINTS / 'step100'}), a DeepSpeed save_checkpoint folder (or its "
        "global_stepN folder), or use --resume for the newest checkpoint of this run"
    )


def _deepspeed_tag_dir(path: Path) -> Path | None:
    """The DeepSpeed tag folder `path` names (a save folder whose `latest` names one, or the tag folder)."""
    from zerotrain.checkpoint.deepspeed_layout import find_deepspeed_tag_dir
    from zerotrain.checkpoint.errors import CheckpointError

    try:
        return find_deepspeed_tag_dir(path, None)
    except CheckpointError as error:  # an unreadable `latest`
        raise RunFolderError(f"training.resume: {error}") from error


def newest_complete_checkpoint(checkpoints: Path) -> ResumePoint | None:
    """The run's newest complete checkpoint: `latest`'s tag, or a newer one a save published but
    was killed before moving `latest` to (a tag folder appears, by rename, only once complete)."""
    steps = [int(p.name[4:]) for p in checkpoints.glob("step*") if _step_number(p.name) and is_checkpoint_tag(p)]
    named = _latest_tag(checkpoints)  # None: no `latest`, or one that is unreadable (then the newest tag)
    newest = checkpoint_tag(max(steps)) if steps else None
    if named is not None and (newest is None or not _step_number(named) or int(named[4:]) >= max(steps)):
        return ResumePoint(checkpoints)  # `latest` is the newest (or names a tag of its own kind)
    return ResumePoint(checkpoints, newest) if newest else None


def _step_number(name: str) -> bool:
    """Whether `name` is a `stepN` tag name with a number of sane length."""
    return name.startswith("step") and name[4:].isdigit() and len(name) <= 24


def _latest_tag(checkpoints: Path) -> str | None:
    """The tag `latest` names, or None when there is none or it is unreadable (checkpoint/reader.py)."""
    from zerotrain.checkpoint.errors import CheckpointError
    from zerotrain.checkpoint.reader import read_latest

    if not (checkpoints / LATEST).is_file():
        return None
    try:
        return read_latest(checkpoints / LATEST)
    except CheckpointError:
        return None


def clear_interrupted_saves(checkpoints: Path) -> list[str]:
    """Removes what saves killed midway left in `checkpoints`: their temporary tag folders, a
    half-written `latest`, and a replaced tag's parked copy once the new one is in place.
    Returns the names removed. Only for a folder no live run writes to."""
    removed = []
    for path in sorted(checkpoints.glob(".*")) if checkpoints.is_dir() else []:
        parked_tag = path.name[len(".old-"):].rsplit("-", 1)[0] if path.name.startswith(".old-") else None
        if path.name.startswith(".tmp-") or is_temp_of(path.name, LATEST) or (
                parked_tag is not None and is_checkpoint_tag(checkpoints / parked_tag)):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def checkpoint_tag(step: int) -> str:
    """The tag `zerotrain train` saves the checkpoint of `step` under."""
    return f"step{step}"


def run_tags_up_to(checkpoints: Path, step: int) -> list[str]:
    """A run's own tags in its checkpoints folder up to `step` (the one resumed from), oldest first."""
    steps = [int(p.name[4:]) for p in checkpoints.glob("step*") if p.name[4:].isdigit()]
    return [checkpoint_tag(s) for s in sorted(steps) if s <= step]


def tags_to_prune(checkpoints: Path, written_by_this_run: list[str], keep: int) -> list[str]:
    """The tags `output.keep_checkpoints` removes: this run's own, oldest first, never `latest`'s."""
    latest = _latest_tag(checkpoints)
    ours = [tag for tag in written_by_this_run if tag != latest and (checkpoints / tag).is_dir()]
    keep_others = max(0, keep - (1 if latest is not None else 0))
    return ours[: max(0, len(ours) - keep_others)]
