"""Accelerate's view of the world when the process group exists before it does.

Axolotl starts the process group itself, then `TrainingArguments` builds Accelerate's state, which
asks `deepspeed.comm.init_distributed` to start the group (a no-op then) and, on a machine without
GPUs, records no backend: it then believes each rank is process 0 of 1.
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # starts processes: `make test`, not `make check`


def _accelerate_world_after_an_early_group() -> tuple[int, int]:
    import os
    import sys

    import torch.distributed as dist

    from zerotrain.compat.deepspeed_standin import STANDIN_DIR

    dist.init_process_group("gloo")  # the script's own group, as Axolotl starts it
    sys.path.insert(0, str(STANDIN_DIR))  # what `zerotrain launch` does for its ranks
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    state = PartialState()
    return state.num_processes, state.process_index


def test_accelerate_sees_every_rank_when_the_script_started_the_group_itself():
    results = run_on_ranks(2, _accelerate_world_after_an_early_group, spawn=True)
    assert results == [(2, 0), (2, 1)]
