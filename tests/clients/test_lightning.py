"""PyTorch Lightning's DeepSpeed strategies on zerotrain, against Lightning's DDP.

tests/fixtures/scripts/lightning_job.py on 2 CPU processes (Lightning starts them), under
`zerotrain run` so that `import deepspeed` is zerotrain. The script lifts only Lightning's own
CUDA-only gate. The stand-in had to report DeepSpeed >= 0.16 (Lightning's minimum with torch 2.6),
have `deepspeed.utils.logging.logger` and `deepspeed.checkpointing.configure`, and accept the
`aio` section Lightning always writes.

One launch for the module (`import lightning` costs each process 7-8 CPU-s): Lightning's DDP,
the reference, then every DeepSpeed strategy, trained one after another in the same processes
(each as it trains alone: fresh seeded model and data). One test per strategy compares its losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from case_launch import CaseLaunch, launch_cases
from conftest import FIXTURES, zerotrain_script

pytest.importorskip("lightning", reason="Lightning is in the dev extra: pip install -e '.[dev]'")
pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

SCRIPT = FIXTURES / "scripts" / "lightning_job.py"
DEEPSPEED_STRATEGIES = ["deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload",
                        "DeepSpeedStrategy(stage=3)"]
STRATEGIES = ["ddp", *DEEPSPEED_STRATEGIES]
"""The reference first: the DeepSpeed strategies then end the processes as their users' scripts do."""
TIMEOUT_S = 600
"""For one launch of all five strategies (about a minute alone on 2 cores; the suite runs beside it)."""


def _losses(launch: CaseLaunch, strategy: str) -> list[list[float]]:
    """The strategy's losses on ranks 0 and 1, from OUT/STRATEGY/."""
    files = [launch.out / strategy / f"losses.{rank}.json" for rank in (0, 1)]
    if not all(file.exists() for file in files):
        launch.fail_for(strategy, ", ".join(map(str, files)))
    return [json.loads(file.read_text()) for file in files]


def _launch(strategies: list[str], folder: Path) -> CaseLaunch:
    command = [zerotrain_script(), "run", "python", str(SCRIPT), ",".join(strategies), str(folder / "out")]
    return launch_cases(command, folder, folder / "out", "lightning_job", TIMEOUT_S)


@pytest.fixture(scope="module")
def strategies(tmp_path_factory) -> CaseLaunch:
    """Lightning's plain DDP (the reference), then every DeepSpeed strategy, in one launch."""
    return _launch(STRATEGIES, tmp_path_factory.mktemp("lightning"))


@pytest.mark.parametrize("strategy", DEEPSPEED_STRATEGIES)
def test_lightning_deepspeed_strategy_matches_lightning_ddp(strategies, strategy):
    losses, reference = _losses(strategies, strategy), _losses(strategies, "ddp")
    for rank in (0, 1):
        assert len(losses[rank]) == 6
        assert losses[rank] == pytest.approx(reference[rank], rel=1e-5)


def test_lightning_deepspeed_strategies_exit_0(strategies):
    """The processes end normally after the DeepSpeed strategies, as their users' scripts do."""
    assert strategies.returncode == 0, (f"`{' '.join(strategies.command)}`: exit {strategies.returncode}\n"
                                        f"{strategies.stdout[-2000:]}\n{strategies.stderr[-6000:]}")
