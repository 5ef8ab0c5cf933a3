"""The end of a multi-node job in a few lines: which node and rank failed first, how, its traceback, wall time."""

from __future__ import annotations

import signal
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from zerotrain.launcher.failures import _exit_code_of
from zerotrain.launcher.node_session import NodeSession
from zerotrain.launcher.ssh import classify_ssh_failure

# How a rank ends when its agent stops it: a consequence of another failure, never the cause.
_STOPPED = {-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT}
_TRACEBACK_LINES = 30


def node_problem(session: NodeSession, via_ssh: bool) -> str | None:
    """Why a node ended without running its ranks (ssh, a missing Python or folder), or None."""
    result = session.result or {}
    if result.get("error"):
        return str(result["error"])
    if session.result is not None or session.returncode in (0, None):
        return None
    own = "\n".join(session.own_lines)
    if via_ssh:
        failure = classify_ssh_failure(session.host, session.returncode, own)
        if failure is not None:
            return failure.message
    if session.returncode == 127:
        return (f"{session.argv[-1] if not via_ssh else 'the Python of this node'} was not found on {session.host}: "
                "the launcher runs the same Python path on every node (same venv/conda path, or a shared filesystem)")
    last = own.strip().splitlines()[-1:] or [""]
    return f"ended with code {session.returncode} before reporting a result {escape(last[0])}".strip()


def _failures(sessions: Sequence[NodeSession]) -> list[dict]:
    found = []
    for session in sessions:
        for failure in (session.result or {}).get("failures", []):
            found.append({**failure, "host": session.host, "node_rank": session.result.get("node_rank")})
    return found


def first_failure(sessions: Sequence[NodeSession]) -> dict | None:
    """The failed rank most likely to be the cause: the first whose code raised, across all nodes."""

    def key(failure: dict) -> tuple[int, float]:
        if failure["noted_time"]:
            return (0, failure["time_ns"])
        if failure["exitcode"] in _STOPPED:
            return (2, failure["time_ns"])
        return (1, failure["time_ns"])

    failures = _failures(sessions)
    return min(failures, key=key) if failures else None


def summarize(sessions: Sequence[NodeSession], wall_s: float, console: Console, *, via_ssh: bool,
              elastic: bool = False, interrupted: str | None = None, failed_first: NodeSession | None = None) -> int:
    """Prints the job's outcome and returns the launcher's exit status."""
    ranks = sum(s.job.nproc for s in sessions)
    if interrupted:
        console.print(f"[yellow]zerotrain launch: interrupted ({interrupted}) after {wall_s:.1f} s; "
                      f"every process of the job on {len(sessions)} nodes is stopped[/]")
        return 128 + int(signal.Signals[interrupted])
    problems = {s.host: p for s in sessions if (p := node_problem(s, via_ssh))}
    failure = first_failure(sessions)
    succeeded = [s for s in sessions if s.returncode == 0]
    if not problems and failure is None and len(succeeded) == len(sessions):
        console.print(f"[green]zerotrain launch: job finished on {len(sessions)} nodes ({ranks} ranks) "
                      f"in {wall_s:.1f} s[/]")
        return 0
    if elastic and succeeded and (failure is None or len(succeeded) + len(problems) >= len(sessions)):
        lost = ", ".join(s.host for s in sessions if s.returncode != 0)
        console.print(f"[green]zerotrain launch: elastic job finished in {wall_s:.1f} s[/] "
                      f"[yellow](nodes lost on the way: {escape(lost)})[/]")
        return 0
    code = 1
    console.rule("[bold red]zerotrain launch failed", style="red")
    if failure is not None:
        how = (f"was killed by {failure['signal']}" if failure["exitcode"] < 0
               else f"exited with code {failure['exitcode']}")
        console.print(f"[bold red]first failure: node {escape(failure['host'])} (node rank {failure['node_rank']}), "
                      f"rank {failure['rank']} (local rank {failure['local_rank']}) {how}[/]")
        tb = (failure.get("traceback") or "").strip().splitlines()
        if tb:
            console.print(escape("\n".join(tb[-_TRACEBACK_LINES:])), soft_wrap=True, highlight=False)
        elif failure.get("message"):
            console.print(f"[red]{escape(failure['message'].strip().splitlines()[-1])}[/]")
        code = _exit_code_of(failure["exitcode"])
    elif failed_first is not None and failed_first.host in problems:
        console.print(f"[bold red]first failure: node {escape(failed_first.host)}:[/] "
                      f"{escape(problems[failed_first.host])}", soft_wrap=True)
    for host, problem in problems.items():
        if failed_first is None or host != failed_first.host or failure is not None:
            console.print(f"node {escape(host)}: {escape(problem)}", soft_wrap=True)
    console.print(f"[dim]wall time {wall_s:.1f} s; every process of the job is stopped on all "
                  f"{len(sessions)} nodes; each rank's output is above, prefixed {escape('[host rank]')}[/]")
    return code
