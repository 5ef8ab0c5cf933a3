"""One rank of a multi-node `zerotrain train` job: `python -m zerotrain.cli.train_rank CONFIG --resume MODE`.

The train worker (zerotrain/train/worker.py), after rank 0 has left the step-time prediction for this
launch in the run folder. A run on one machine predicts before it starts its ranks; across nodes only
the ranks know the world they make up, and `train` may not import `planning`, so the command layer
names this module as the nodes' target.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zerotrain.system.process_exit import end_rank


def main(argv: list[str] | None = None) -> int:
    from zerotrain.train import worker

    args = sys.argv[1:] if argv is None else argv
    if os.environ.get("RANK") == "0" and args:
        _leave_prediction(args[0])
    return worker.main(args)


def _leave_prediction(config: str) -> None:
    from zerotrain.cli.train_prediction import predict_train_step
    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.step_prediction import write_prediction

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_train_config(config)
        prediction = predict_train_step(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except Exception as error:  # noqa: BLE001 - a prediction must never stop a run: say so and train
        print(f"zerotrain train: no step-time prediction ({type(error).__name__}: {error})", file=sys.stderr)
        return
    if prediction is not None:
        write_prediction(Path(cfg.output.dir), prediction)


if __name__ == "__main__":
    end_rank(main())  # a finished rank skips the interpreter's teardown
