"""The node agent: what `zerotrain launch` runs on every node of a multi-node job.

Two processes per node:

- the **supervisor** (``python -m zerotrain.launcher.node_agent``) reads the
  NodeJob, starts the agent, and listens to the launcher on stdin: a
  ``dump-stacks`` line makes every rank print its Python stack; end of input (the
  launcher stopped, failed or was killed, so its ssh connection closed) ends the
  job on this node. When the agent is gone it ends whatever of the job is left
  on the node (found by job id), then prints the node's result as one line.
- the **agent** (``--run-agent``) is torch's elastic agent (``torch.distributed.run``)
  for this node, run in-process so its failure record can be read.

The supervisor is a separate process so that it outlives anything that happens
to the agent, SIGKILL included, and still cleans up the node.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zerotrain.compat.deepspeed_standin import with_standin
from zerotrain.launcher.job_processes import job_processes, kill_job_processes, signal_processes
from zerotrain.system.process_exit import run_then_exit
from zerotrain.launcher.node_job import DUMP_STACKS_COMMAND, JOB_ID_ENV, NODE_RANK_ENV, RESULT_MARK, NodeJob

# How long the agent gets to stop its ranks (it sends them SIGTERM) before every process
# of the job on the node is killed: well inside the 30 s a job may take to end.
STOP_GRACE_S = 10.0
# How often, while the agent stops its ranks, the stopped ones among them are continued (SIGCONT).
_RESUME_INTERVAL_S = 0.5
_RESULT_FILE = "result.json"
_JOB_FILE = "job.json"


# --- supervisor --------------------------------------------------------------------------------

def _raise_open_file_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: Gloo and NCCL open sockets per peer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def _emit_result(result: dict) -> None:
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def _listen_to_launcher(job: NodeJob, node_rank: int, agent: subprocess.Popen, stopping: threading.Event) -> None:
    """Serves the launcher's commands on stdin; at end of input, stops the job on this node."""
    for line in sys.stdin:
        if line.strip() == DUMP_STACKS_COMMAND:
            ranks = [pid for pid in job_processes(job.job_id, node_rank) if pid != agent.pid]
            signal_processes(ranks, signal.SIGUSR1)
    stopping.set()
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        _wait_for_agent_to_stop(job, node_rank, agent)
    kill_job_processes(job.job_id, node_rank, grace_s=1.0)


def _wait_for_agent_to_stop(job: NodeJob, node_rank: int, agent: subprocess.Popen) -> None:
    """Up to STOP_GRACE_S for the agent to stop its ranks, continuing any of the job's processes that is stopped.

    torch's agent sends its ranks SIGTERM and no SIGCONT: a rank stopped by SIGSTOP (a hang, a
    debugger's pause) would act on it only when the agent gives up and kills it, the agent with it.
    """
    deadline = time.monotonic() + STOP_GRACE_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            agent.wait(min(_RESUME_INTERVAL_S, left))
            return
        except subprocess.TimeoutExpired:
            # SIGCONT is a no-op for a running process: no need to tell which ones are stopped.
            signal_processes(job_processes(job.job_id, node_rank), signal.SIGCONT)


def supervise(job: NodeJob, *, listen: bool) -> int:
    """Runs the node's share of `job` and returns its exit status; prints the result line last."""
    node_rank = job.resolved_node_rank()
    if not job.host:  # started by srun for every node at once: this node's name labels its lines
        job = dataclasses.replace(job, host=os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    if not os.path.isdir(job.cwd):
        _emit_result({"host": job.host, "exitcode": 2, "error": f"working directory {job.cwd} does not exist on "
                      f"{job.host}: use the same path on every node (a shared filesystem), or launch from one that exists"})
        return 2
    _raise_open_file_limit()
    workdir = Path(tempfile.mkdtemp(prefix="zerotrain-node-"))
    (workdir / _JOB_FILE).write_text(job.to_json())
    # `import deepspeed` in the ranks means this node's zerotrain (the path sent with the job's
    # PYTHONPATH is the launching machine's).
    env = with_standin({**os.environ, **job.env, JOB_ID_ENV: job.job_id, NODE_RANK_ENV: str(node_rank)})
    agent = subprocess.Popen(
        [sys.executable, "-u", "-m", "zerotrain.launcher.node_agent", "--run-agent", str(workdir)],
        cwd=job.cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    stopping = threading.Event()
    if listen:
        threading.Thread(target=_listen_to_launcher, args=(job, node_rank, agent, stopping), daemon=True).start()
    try:
        code = agent.wait()
    except KeyboardInterrupt:  # no_ssh mode, run in a terminal
        agent.send_signal(signal.SIGTERM)
        code = agent.wait()
    # Whatever of the job the agent left behind on this node (it was killed, or a rank ignored SIGTERM).
    kill_job_processes(job.job_id, node_rank, grace_s=2.0)
    result = {"host": job.host, "node_rank": node_rank, "exitcode": code, "stopped": stopping.is_set()}
    try:
        result.update(json.loads((workdir / _RESULT_FILE).read_text()))
    except (OSError, ValueError):
        if code < 0:
            result["error"] = f"the node agent was killed by {signal.Signals(-code).name}"
    shutil.rmtree(workdir, ignore_errors=True)
    _emit_result(result)
    return code if code >= 0 else 128 - code


# --- agent ---------------------------------------------------------------------------------------

def _has_nvidia_gpus() -> bool:
    import torch

    return torch.cuda.device_count() > 0


def _bind_cores_env(job: NodeJob) -> None:
    if job.bind_cores:
        os.environ["ZEROTRAIN_BIND_CORES"] = "1"  # the bootstrap pins each rank to its share


def torchrun_flags(job: NodeJob, node_rank: int) -> list[str]:
    """torchrun's flags for this node: a static rendezvous, or c10d for elastic training."""
    from zerotrain.launcher.local import MONITOR_INTERVAL_S

    flags = [f"--nproc_per_node={job.nproc}", f"--monitor_interval={MONITOR_INTERVAL_S}", "--tee=3"]
    if job.elastic:
        return [
            *flags, f"--nnodes={job.min_nodes or 1}:{job.nnodes}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={job.master_addr}:{job.master_port}", f"--rdzv_id={job.job_id}",
            # Node 0 hosts the store: torch would otherwise guess from the address, and every
            # loopback address looks like this machine's own.
            f"--rdzv_conf=is_host={1 if node_rank == 0 else 0}", f"--max_restarts={job.max_restarts}",
        ]
    return [
        *flags, f"--nnodes={job.nnodes}", f"--node_rank={node_rank}", "--rdzv_backend=static",
        f"--master_addr={job.master_addr}", f"--master_port={job.master_port}", "--max_restarts=0",
    ]


def user_traceback(text: str) -> str:
    """`text` (a formatted traceback) without its leading frames from torch's ``record``, runpy and the bootstrap."""
    lines = text.splitlines()
    internal = ("torch/distributed/elastic/", "<frozen runpy>", "runpy.py", "zerotrain/launcher/bootstrap.py")
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    cut = None
    for index in frames:
        if any(part in lines[index] for part in internal):
            cut = index
        else:
            break
    if cut is None or not lines:
        return text
    rest = lines[cut + 1:]
    while rest and not rest[0].lstrip().startswith('File "'):
        rest = rest[1:]  # the internal frame's own source lines
    return "\n".join([lines[0], *rest])


def _failure_record(rank: int, failure, failure_times: dict[int, int]) -> dict:
    message = getattr(failure, "message", "")
    traceback_text = ""
    if isinstance(message, dict):
        traceback_text = user_traceback(str((message.get("extraInfo") or {}).get("py_callstack", "")))
        message = message.get("message", "")
    return {
        "rank": rank, "local_rank": failure.local_rank, "pid": failure.pid, "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "time_ns": failure_times.get(rank, int(failure.timestamp * 1e9)), "noted_time": rank in failure_times,
        "message": str(message or ""), "traceback": traceback_text,
    }


def run_agent(workdir: Path) -> int:
    """Runs torch's elastic agent for this node; leaves the outcome in workdir/result.json."""
    from zerotrain.launcher import bootstrap
    from zerotrain.launcher.failures import _exit_code_of, read_failure_times
    from zerotrain.launcher.local import quiet_agent_logs, worker_command

    job = NodeJob.from_json((workdir / _JOB_FILE).read_text())
    node_rank = job.resolved_node_rank()
    failure_dir = workdir / "failures"
    failure_dir.mkdir()
    os.environ.update({
        bootstrap.FAILURE_TIMES_ENV: str(failure_dir),
        # DeepSpeed's names for the node's place in the job.
        "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(job.nnodes), "LOCAL_SIZE": str(job.nproc),
        # Each output line says where it comes from: "[host rank]: ...".
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[{job.host} ${{rank}}]: ",
    })
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.nproc)))
    _bind_cores_env(job)
    if "CUDA_VISIBLE_DEVICES" not in job.env and _has_nvidia_gpus():
        slots = job.slots if job.slots is not None else range(job.nproc)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = torchrun_flags(job, node_rank) + worker_command(
        job.target, job.target_args, module=job.module, no_python=job.no_python, local_rank_arg=job.local_rank_arg
    )
    result: dict = {}
    code = 0
    try:
        with quiet_agent_logs():
            run(parse_args(argv))
    except ChildFailedError as error:
        times = read_failure_times(str(failure_dir))
        failures = [_failure_record(rank, f, times) for rank, f in (error.failures or {}).items()]
        result["failures"] = failures
        first = min(failures, key=lambda f: f["time_ns"]) if failures else None
        code = _exit_code_of(first["exitcode"]) if first else 1
    except SignalException as error:
        code = 128 + int(error.sigval)
        result["signal"] = signal.Signals(error.sigval).name
    except Exception as error:  # noqa: BLE001 - e.g. the rendezvous could not be reached
        result["error"] = f"{type(error).__name__}: {error}"
        code = 1
    (workdir / _RESULT_FILE).write_text(json.dumps(result))
    return code


def main(argv: list[str] | None = None) -> int:
    """``node_agent [--job B64 | --run-agent WORKDIR]``; without either, the job is stdin's first line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-agent"]:
        return run_agent(Path(argv[1]))
    if argv[:1] == ["--job"]:
        return supervise(NodeJob.from_b64(argv[1]), listen=False)
    line = sys.stdin.readline()
    if not line.strip():
        print("zerotrain node agent: no job description on stdin", file=sys.stderr)
        return 2
    return supervise(NodeJob.from_json(line), listen=True)


if __name__ == "__main__":
    run_then_exit(main)  # without the interpreter's teardown: zerotrain/system/process_exit.py
