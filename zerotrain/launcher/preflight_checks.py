"""What the pre-flight checks judge, and how: a node's answers to the probe become ok / warn / fail
cells with the fix (thresholds in `preflight.py`'s docstring). The ssh round trip that collects the
answers, and the table, are `preflight.py`'s."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerotrain.launcher.node_plan import Node
from zerotrain.launcher.ssh import SshOptions, classify_ssh_failure

PROBE_MARKER = "ZEROTRAIN_PREFLIGHT "

RECOMMENDED_OPEN_FILES = 65536

# Resource limits the node agent raises from soft to hard before starting ranks (node_agent.py):
# for these the hard limit is what the job gets.
LIMITS_RAISED_TO_HARD = frozenset({"nofile"})

# Column key -> table heading, in table order.
COLUMNS: dict[str, str] = {
    "ssh": "ssh",
    "python": "python",
    "cwd": "cwd",
    "target": "target",
    "torch": "torch",
    "zerotrain": "zerotrain",
    "gpus": "GPUs",
    "nofile": "ulimit -n",
    "memlock": "ulimit -l",
    "master_port": "master port",
}

_SAME_ENV_FIX = ("install the same environment at the same path on every node (same venv/conda path), "
                 "or use a shared filesystem")

# The ssh check's (text, cell) per SshFailure kind; the failure's own message (which names the
# host and says how to fix it) becomes the check's fix.
_SSH_LABELS = {
    "refused": ("ssh connection refused", "refused"),
    "timeout": ("ssh timed out", "timed out"),
    "auth": ("ssh permission denied", "denied"),
    "dns": ("ssh: unknown host name", "unknown host"),
    "host-key": ("ssh: host key not accepted", "host key"),
    "unreachable": ("ssh: host unreachable", "unreachable"),
    "other": ("ssh failed", "failed"),
}

@dataclass(frozen=True)
class Check:
    """One cell of the table."""

    status: str
    """"ok", "warn", "fail", or "skip" (not checked because an earlier check failed; shown as "-")."""
    text: str
    """What was found, as a line of its own (the failure and warning lines)."""
    fix: str = ""
    short: str = ""
    """What the table cell shows, when shorter than `text`."""

    @property
    def cell(self) -> str:
        return self.short or self.text


SKIP = Check("skip", "-")

@dataclass(frozen=True)
class PreflightRequest:
    """What the job will run, where: everything the checks compare the nodes against."""

    nodes: Sequence[Node]
    python: str
    """The launching node's sys.executable: the same path is used on every node."""
    cwd: str
    """The launching node's working directory: the same is used on every node."""
    target: str
    """Script path (as given, relative to cwd), module name, or program."""
    target_kind: str
    """"script" | "module" | "program"."""
    master_addr: str
    master_port: int
    ssh: SshOptions
    world_size: int


@dataclass
class NodeReport:
    """The checks of one node, keyed by column (see COLUMNS)."""

    node: Node
    checks: dict[str, Check] = field(default_factory=dict)


@dataclass
class PreflightReport:
    """The checks of every node, in node order."""

    nodes: list[NodeReport]

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not stop the job)."""
        return not self.failures()

    def failures(self) -> list[str]:
        """One line per failed check: "HOST: what; fix"."""
        return self._lines("fail")

    def warnings(self) -> list[str]:
        """One line per warning: "HOST: what; fix"."""
        return self._lines("warn")

    def _lines(self, status: str) -> list[str]:
        return [
            f"{report.node.host}: {check.text}" + (f"; {check.fix}" if check.fix else "")
            for report in self.nodes
            for check in report.checks.values()
            if check.status == status
        ]


def min_open_files(world_size: int) -> int:
    """Fewest open files (hard limit) a rank of a `world_size` job needs: max(1024, 64 * world_size)."""
    return max(1024, 64 * world_size)


def parse_probe_output(stdout: str) -> dict[str, Any] | None:
    """The probe's answer from a node's stdout (the last marked line), or None if there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            try:
                return json.loads(line[len(PROBE_MARKER):])
            except json.JSONDecodeError:
                return None
    return None


def judge_preflight(request: PreflightRequest, results: Mapping[str, subprocess.CompletedProcess]) -> PreflightReport:
    """Turns every node's ssh result into its row of checks."""
    facts = {node.host: parse_probe_output(results[node.host].stdout or "") if node.host in results else None
             for node in request.nodes}
    # Versions are compared with node 0's; if node 0 did not answer, with the first node that did.
    reference = next(((node, facts[node.host]) for node in request.nodes if facts[node.host]), None)
    node0 = next((node for node in request.nodes if node.node_rank == 0), None)
    master_listening = bool(node0 and facts[node0.host] and facts[node0.host]["port"].get("ok"))
    reports = []
    for node in request.nodes:
        found = facts[node.host]
        if found is None:
            checks = _unanswered(node, request, results.get(node.host))
        else:
            checks = _judge_facts(node, request, found, reference, master_listening)
        reports.append(NodeReport(node, {key: checks.get(key, SKIP) for key in COLUMNS}))
    return PreflightReport(reports)


def _unanswered(node: Node, request: PreflightRequest, result: subprocess.CompletedProcess | None) -> dict[str, Check]:
    """The checks of a node whose probe gave no answer: ssh failed, Python is missing, or the probe broke."""
    host = node.host
    if result is None:
        return {"ssh": Check("fail", f"no result from {host}", f"run `ssh {host} true` to see why")}
    stderr = result.stderr or ""
    # run_on_hosts reports a host it had to stop (timeout_s) as an ssh "timeout" failure too.
    failure = classify_ssh_failure(host, result.returncode, stderr)
    if failure is not None:
        text, short = _SSH_LABELS.get(failure.kind, _SSH_LABELS["other"])
        return {"ssh": Check("fail", text, failure.message, short)}
    ssh_ok = Check("ok", "ok")
    if result.returncode == 127 or (result.returncode != 0 and "No such file or directory" in stderr):
        missing = Check("fail", f"python not found: {request.python}", _SAME_ENV_FIX, "not found")
        return {"ssh": ssh_ok, "python": missing}
    if result.returncode == 126:
        return {"ssh": ssh_ok, "python": Check("fail", f"python not executable: {request.python}", _SAME_ENV_FIX,
                                                     "not executable")}
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "no output")
    what = f"pre-flight probe failed (exit {result.returncode}): {last}"
    return {"ssh": ssh_ok, "python": Check("fail", what, f"run {request.python} on {host} to see why", "probe failed")}


def _judge_facts(
    node: Node,
    request: PreflightRequest,
    facts: Mapping[str, Any],
    reference: tuple[Node, Mapping[str, Any]] | None,
    master_listening: bool,
) -> dict[str, Check]:
    checks = {"ssh": Check("ok", "ok")}
    for key in ("python", "torch", "zerotrain"):
        checks[key] = _judge_version(key, node, request, facts, reference)
    if facts["cwd_exists"]:
        checks["cwd"] = Check("ok", "ok")
        checks["target"] = _judge_target(request, facts["target_present"])
    else:  # the target is looked for in cwd: not checked
        checks["cwd"] = Check("fail", f"cwd missing: {request.cwd}", "the job runs in the launching directory on "
                              "every node: create it there, or use a shared filesystem", "missing")
    checks["gpus"] = _judge_gpus(node, facts["gpus"])
    checks["nofile"] = _judge_open_files(facts["nofile"], request.world_size, facts["gpus"] > 0)
    checks["memlock"] = _judge_memlock(facts["memlock"], facts["gpus"] > 0)
    checks["master_port"] = _judge_port(node, request, facts["port"], master_listening)
    return checks


def _judge_version(
    key: str,
    node: Node,
    request: PreflightRequest,
    facts: Mapping[str, Any],
    reference: tuple[Node, Mapping[str, Any]] | None,
) -> Check:
    version = facts.get(key)
    if version is None:
        fix = f"pip install {key} into {request.python} on {node.host}"
        return Check("fail", f"{key} not installed", fix, "missing")
    if reference is None or reference[0] == node:
        return Check("ok", version)
    ref_node, ref_facts = reference
    wanted = ref_facts.get(key)
    if wanted is None or wanted == version:
        return Check("ok", version)
    fix = _SAME_ENV_FIX if key == "python" else f"pip install {key}=={wanted} into {request.python} on {node.host}"
    where = f"node 0 ({ref_node.host})" if ref_node.node_rank == 0 else ref_node.host
    return Check("fail", f"{key} {version} here, {wanted} on {where}", fix, f"{version} != {wanted}")


def _judge_target(request: PreflightRequest, present: bool) -> Check:
    if present:
        return Check("ok", "ok")
    target, kind = request.target, request.target_kind
    if kind == "script":
        return Check("fail", f"script not found: {target} (in {request.cwd})",
                     "copy it to the same path on every node, or use a shared filesystem", "missing")
    if kind == "module":
        return Check("fail", f"module not found: {target.split('.')[0]} (in {request.cwd} or {request.python})",
                     f"put it under {request.cwd} on every node, or pip install it into {request.python}", "missing")
    return Check("fail", f"program not found: {target}", "install it on every node, on the PATH ssh sessions get",
                 "missing")


def _judge_gpus(node: Node, gpus: int) -> Check:
    if gpus == 0:
        return Check("ok", "CPU")
    needed = max(node.nproc, max(node.slots, default=-1) + 1)
    if gpus < needed:
        slots = ",".join(map(str, node.slots))
        return Check("fail", f"{gpus} GPU{'s' if gpus > 1 else ''}, slots {slots} need {needed}",
                     f"give {node.host} at most {gpus} slots (GPUs 0..{gpus - 1}) in the hostfile or --include",
                     f"{gpus} < {needed}")
    return Check("ok", str(gpus))


def _limit_text(soft: int | None, hard: int | None, unit: int = 1) -> str:
    """"soft/hard" (or one number when equal) in `unit`s, as `ulimit` prints them."""

    def show(value: int | None) -> str:
        return "unlimited" if value is None else str(value // unit)

    return show(soft) if soft == hard else f"{show(soft)}/{show(hard)}"


def _judge_open_files(limits: Sequence[int | None], world_size: int, gpu_node: bool = True) -> Check:
    soft, hard = limits
    effective = hard if "nofile" in LIMITS_RAISED_TO_HARD else soft
    text = _limit_text(soft, hard)
    minimum = min_open_files(world_size)
    recommended = max(RECOMMENDED_OPEN_FILES, minimum)
    fix = (
        f"raise the open-files limit to {recommended}: `ulimit -n {recommended}`, nofile in "
        f"/etc/security/limits.conf, or LimitNOFILE= in the sshd/systemd unit"
    )
    if effective is not None and effective < minimum:
        return Check("fail", f"ulimit -n {text}, below {minimum} needed for {world_size} ranks", fix,
                     f"{text} < {minimum}")
    # The recommendation is NCCL's; Gloo on CPU nodes is fine with the minimum.
    if effective is not None and effective < recommended and gpu_node:
        return Check("warn", f"ulimit -n {text}, below {recommended}", fix, f"{text} < {recommended}")
    return Check("ok", text, short=_limit_text(effective, effective))


def _judge_memlock(limits: Sequence[int | None], gpu_node: bool) -> Check:
    soft, hard = limits
    effective = hard if "memlock" in LIMITS_RAISED_TO_HARD else soft
    text = _limit_text(soft, hard, unit=1024) + (" KiB" if effective is not None else "")
    if gpu_node and effective is not None:
        return Check("warn", f"ulimit -l {text}, not unlimited", "NCCL over InfiniBand locks memory: set memlock "
                     "unlimited in /etc/security/limits.conf (or LimitMEMLOCK=infinity in the sshd/systemd unit)", text)
    return Check("ok", text)


def _judge_port(node: Node, request: PreflightRequest, port: Mapping[str, Any], master_listening: bool) -> Check:
    p, addr, host = request.master_port, request.master_addr, node.host
    node0_host = next(n.host for n in request.nodes if n.node_rank == 0)
    if port.get("role") == "listen":
        if port.get("ok"):
            return Check("ok", f"listening on {p}", short="listening")
        error = port.get("error", "bind failed")
        if "ermission" in error:  # a port below 1024 without root
            return Check("fail", f"port {p} not allowed on {host} ({error})", "pass a --master_port above 1023",
                         "not allowed")
        return Check("fail", f"port {p} busy on {host} ({error})",
                     f"pass another --master_port, or stop the job using port {p} on {host}", "busy")
    if not master_listening:
        return SKIP  # node 0 did not listen: whatever answered (or not) says nothing
    if port.get("ok"):
        return Check("ok", f"reached {addr}:{p}", short="reached")
    if port.get("foreign"):
        return Check("fail", f"{addr}:{p} is not node 0 ({node0_host}) as seen from {host}",
                     "pass --master_addr an address of node 0 that every node can reach", "not node 0")
    return Check("fail", f"cannot reach {addr}:{p} from {host} ({port.get('error', 'failed')})",
                 f"open port {p} in node 0's firewall, or pass --master_addr an address of node 0 that {host} "
                 "can reach", "unreachable")
