"""PyTorch Lightning's DeepSpeed strategies on zerotrain, against Lightning's DDP.

tests/fixtures/scripts/lightning_job.py on 2 CPU processes (Lightning starts them), under
`zerotrain run` so that `import deepspeed` is zerotrain. The script lifts only Lightning's own
CUDA-only gate. The stand-in had to report DeepSpeed >= 0.16 (Lightning's minimum with torch 2.6),
have `deepspeed.utils.logging.logger` and `deepspeed.checkpointing.configure`, and accept the
`aio` section Lightning always writes.

Two launches for the module: every DeepSpeed strategy in one, trained one after another in the
same processes (each as it trains alone: fresh seeded model and data), and the DDP reference in
the other. One test per strategy compares its losses.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FIXTURES, device_env, user_env, zerotrain_script

pytest.importorskip("lightning", reason="Lightning is in the dev extra: pip install -e '.[dev]'")
pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

SCRIPT = FIXTURES / "scripts" / "lightning_job.py"
DEEPSPEED_STRATEGIES = ["deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload",
                        "DeepSpeedStrategy(stage=3)"]
TIMEOUT_S = 600
"""For one launch of all four strategies (under a minute alone on 2 cores; the suite runs beside it)."""


@dataclass
class Launch:
    """One finished launch of lightning_job.py: its command, exit status, output and results folder."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    out: Path

    def losses(self, strategy: str) -> list[list[float]]:
        """The strategy's losses on ranks 0 and 1; a failure naming the strategy, the exit status and
        the strategy's part of stderr if a rank wrote none."""
        files = [self.out / strategy / f"losses.{rank}.json" for rank in (0, 1)]
        if not all(file.exists() for file in files):
            started = f"lightning_job: {strategy} starts" in self.stderr
            what = "started and wrote no" if started else "never started (a strategy before it failed): no"
            pytest.fail(f"{strategy} {what} {', '.join(map(str, files))}:\n`{' '.join(self.command)}` exited "
                        f"{self.returncode}\n{self.stdout[-2000:]}\n{self.stderr_of(strategy)}", pytrace=False)
        return [json.loads(file.read_text()) for file in files]

    def stderr_of(self, strategy: str) -> str:
        """The end of stderr from the first line the script prints as `strategy` starts (all of it
        if the launch ended before): a failing strategy's traceback, without the earlier ones' logs."""
        start = self.stderr.find(f"lightning_job: {strategy} starts")
        return self.stderr[max(start, 0):][-6000:]


def _launch(strategies: list[str], folder: Path) -> Launch:
    command = [zerotrain_script(), "run", "python", str(SCRIPT), ",".join(strategies), str(folder / "out")]
    done = subprocess.run(command, cwd=folder, env=user_env(**device_env("cpu")), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    return Launch(command, done.returncode, done.stdout, done.stderr, folder / "out")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Launch:
    """Lightning's plain DDP: the reference."""
    return _launch(["ddp"], tmp_path_factory.mktemp("lightning-ddp"))


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory) -> Launch:
    """Every DeepSpeed strategy, one after another in one launch."""
    return _launch(DEEPSPEED_STRATEGIES, tmp_path_factory.mktemp("lightning-deepspeed"))


@pytest.mark.parametrize("strategy", DEEPSPEED_STRATEGIES)
def test_lightning_deepspeed_strategy_matches_lightning_ddp(ddp, deepspeed, strategy):
    losses, reference = deepspeed.losses(strategy), ddp.losses("ddp")
    for rank in (0, 1):
        assert len(losses[rank]) == 6
        assert losses[rank] == pytest.approx(reference[rank], rel=1e-5)


def test_lightning_deepspeed_strategies_exit_0(deepspeed):
    """The DeepSpeed strategies' processes end normally, as their users' scripts do."""
    assert deepspeed.returncode == 0, (f"`{' '.join(deepspeed.command)}`: exit {deepspeed.returncode}\n"
                                       f"{deepspeed.stdout[-2000:]}\n{deepspeed.stderr[-6000:]}")
