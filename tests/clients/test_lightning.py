"""PyTorch Lightning's DeepSpeed strategies on zerotrain, against Lightning's DDP.

tests/fixtures/scripts/lightning_job.py on 2 CPU processes (Lightning starts them), under
`zerotrain run` so that `import deepspeed` is zerotrain. The script lifts only Lightning's own
CUDA-only gate. The stand-in had to report DeepSpeed >= 0.16 (Lightning's minimum with torch 2.6),
have `deepspeed.utils.logging.logger` and `deepspeed.checkpointing.configure`, and accept the
`aio` section Lightning always writes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import FIXTURES, device_env, user_env, zerotrain_script

pytest.importorskip("lightning", reason="Lightning is in the dev extra: pip install -e '.[dev]'")
pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

SCRIPT = FIXTURES / "scripts" / "lightning_job.py"


def _losses(strategy: str, folder) -> list[list[float]]:
    out = folder / "losses"
    done = subprocess.run([zerotrain_script(), "run", "python", str(SCRIPT), strategy, str(out)], cwd=folder,
                          env=user_env(**device_env("cpu")), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{strategy}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    return [json.loads((folder / f"losses.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _losses("ddp", tmp_path_factory.mktemp("lightning-ddp"))


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload",
                                      "DeepSpeedStrategy(stage=3)"])
def test_lightning_deepspeed_strategy_matches_lightning_ddp(ddp, tmp_path, strategy):
    losses = _losses(strategy, tmp_path)
    for rank in (0, 1):
        assert len(losses[rank]) == 6
        assert losses[rank] == pytest.approx(ddp[rank], rel=1e-5)
