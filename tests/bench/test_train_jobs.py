"""`zerotrain bench run` of `zerotrain train` jobs: docs/bench.md's `--module zerotrain train my.yaml` runs as
written (no `--no_local_rank` needed), and a relative `output.dir` lands in each job's own folder. The
end-to-end cases run the installed command on real sshd "nodes" 127.0.0.41-42."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

import pytest

from zerotrain.bench.job_target import job_target

REPO = Path(__file__).resolve().parents[2]
# A `zerotrain train` config that trains 2 steps in seconds on a CPU; its output.dir is relative.
TINY_CONFIG = """\
model:
  architecture: llama
  tokenizer: byte
  config_overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2,
                     num_key_value_heads: 2, vocab_size: 512}
data:
  format: synthetic
  seq_len: 64
  eval_fraction: 0
  synthetic: {task: arithmetic, num_examples: 2000}
training: {micro_batch_size: 2, max_steps: 2, warmup_steps: 0, eval_interval: 0, save_interval: 0}
logging: {interval: 1, csv: true, progress_bar: false}
output: {dir: out, export_hf: false, save_final: false}
"""


def _documented_module_command() -> list[str]:
    """docs/bench.md's `zerotrain bench run ... -- --module zerotrain train my.yaml`, as words."""
    for line in (REPO / "docs" / "bench.md").read_text().splitlines():
        if line.startswith("zerotrain bench run ") and line.endswith("-- --module zerotrain train my.yaml"):
            return shlex.split(line)
    pytest.fail("docs/bench.md no longer shows `zerotrain bench run ... -- --module zerotrain train my.yaml`")


def _hostfiles(folder: Path, nodes) -> None:
    folder.mkdir(parents=True)
    for index, node in enumerate(nodes, start=1):
        (folder / f"batch-{index:03d}").write_text(f"{node} slots=1\n")


def _with_flags(words: list[str], *flags: str) -> list[str]:
    """`words` with launch flags before the `--` (the test cluster's ssh config, its own data cache)."""
    cut = words.index("--")
    return [*words[:cut], *flags, *words[cut:]]


def _cluster_flags(cluster, cwd: Path) -> list[str]:
    return ["--ssh_args", cluster.ssh_args, "--env", f"ZEROTRAIN_CACHE={cwd.parent / 'cache'}"]


@pytest.mark.slow
def test_the_documented_module_zerotrain_train_command_runs_as_written_and_writes_each_jobs_relative_output_dir(
        make_ssh_nodes, zerotrain_cli):
    # One bench run checks both facets: the documented form needs no `--no_local_rank`, and the config's
    # relative output.dir lands in each job's own folder (two jobs, else one shared folder would pass).
    nodes = ["127.0.0.41", "127.0.0.42"]
    cluster = make_ssh_nodes(nodes)
    cwd = zerotrain_cli.cwd
    words = _documented_module_command()  # zerotrain bench run hostfiles/ --timeout 600 --out runs/bench-3 -- ...
    _hostfiles(cwd / words[3], nodes)
    (cwd / "my.yaml").write_text(TINY_CONFIG)  # output.dir: out
    done = zerotrain_cli(*_with_flags(words[1:], *_cluster_flags(cluster, cwd)), timeout=300)
    output = done.stdout + done.stderr
    run = cwd / words[words.index("--out") + 1]
    assert done.returncode == 0, output + (run / "batch-001" / "log.txt").read_text()[-3000:]
    assert "batch-001  127.0.0.41  finished" in done.stdout and "batch-002  127.0.0.42  finished" in done.stdout, output
    for job in ("batch-001", "batch-002"):
        with (run / job / "out" / "metrics.csv").open() as f:
            assert [row["step"] for row in csv.DictReader(f)] == ["1", "2"], job
    assert not (cwd / "out").exists()  # not the bench's own folder, where every job would write


def test_zerotrain_modules_get_no_local_rank_and_train_a_job_folder_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text(TINY_CONFIG)
    job = tmp_path / "run" / "batch-001"
    assert job_target(["--module", "zerotrain", "train", "my.yaml"], ["--force_multi"], job) == [
        "--no_local_rank", "--module", "zerotrain", "train", "my.yaml", "--output.dir", str(job / "out")]
    # --no_local_rank given by hand among bench run's flags (as docs/bench.md once asked) is not given twice.
    assert job_target(["--module", "zerotrain", "train", "my.yaml"], ["--no_local_rank", "--force_multi"], job) == [
        "--module", "zerotrain", "train", "my.yaml", "--output.dir", str(job / "out")]
    # --module before `--` (a bench run flag); an override's relative dir; a value-taking launch flag first.
    assert job_target(["--num_gpus", "1", "zerotrain", "train", "my.yaml", "--output.dir", "o2"],
                      ["--module"], job)[-2:] == ["--output.dir", str(job / "o2")]
    absolute = ["--no_local_rank", "--module", "zerotrain", "train", "my.yaml", "--output.dir", str(tmp_path / "x")]
    assert job_target(absolute, [], job) == absolute
    assert job_target(["--module", "zerotrain.bench.comm_worker", "--iters", "2"], [], job)[0] == "--no_local_rank"
    for other in (["train.py", "--output.dir", "out"], ["--module", "mypkg.train", "my.yaml"]):
        assert job_target(other, [], job) == other  # other scripts take --local_rank and own their arguments
    broken = ["--module", "zerotrain", "train", "missing.yaml"]  # the job itself will say what is wrong
    assert job_target(broken, [], job) == ["--no_local_rank", *broken]
