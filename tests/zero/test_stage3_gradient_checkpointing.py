"""Stage 3 with Hugging Face gradient checkpointing: layers recomputed in backward are gathered again."""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import train_reference, train_zerotrain, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _train_checkpointed(reuse: int):
    config = zero_config(3, 2, 1, stage3_max_reuse_distance=reuse)
    run = train_zerotrain(config, checkpointing=True)
    return run["losses"], run["weights"]


@pytest.mark.parametrize("reuse", [0, 10**9], ids=["free-after-forward", "reuse-default"])
def test_stage3_with_gradient_checkpointing_matches_single_process_training(reuse):
    ref_losses, ref_weights = train_reference()
    (losses0, weights0), (losses1, _) = run_on_ranks(2, _train_checkpointed, reuse)
    # each rank reports its own micro-batch loss; their mean is the global batch's loss
    mean = [(a + b) / 2 for a, b in zip(losses0, losses1)]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
    for name, ref in ref_weights.items():
        assert (weights0[name] - ref).norm() <= 1e-5 * ref.norm() + 1e-7, name
