"""One rank of a `zerotrain train` job started on this machine: `python -m zerotrain.train.worker CONFIG --resume MODE`.

`zerotrain train` validates the config, writes the merged result to the run directory
and starts N of these; each reads that file, so every rank trains on the same settings.
"""

from __future__ import annotations

import argparse

from zerotrain.system.process_exit import end_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerotrain.train.worker")
    parser.add_argument("config", help="the merged config.yaml written by zerotrain train")
    parser.add_argument("--resume", default="never", help='"auto", "never" or a checkpoint directory')
    args = parser.parse_args(argv)

    from zerotrain.train.rank_run import run_in_this_process
    from zerotrain.train.config_files import load_train_config

    return run_in_this_process(load_train_config(args.config), args.resume)


if __name__ == "__main__":
    end_rank(main())  # a finished rank skips the interpreter's teardown
