"""Real sshd servers on loopback addresses, standing in for the nodes of a multi-node job.

Every address of 127.0.0.0/8 reaches this machine on Linux, so one sshd per address
(127.0.0.2, 127.0.0.3, ...) gives tests several "hosts" that ssh really logs in to.
Everything they need (keys, sshd_config, an ssh_config with a ``Host`` block and a
``nodeN`` alias per node, logs) lives in one folder; nothing under ~/.ssh or /etc/ssh
is read or written. Each sshd runs in the foreground, so the pid we hold is the daemon.
Works as root and, with the limits of the account, as an ordinary user: sshd then
only lets that user in.
"""

from __future__ import annotations

import os
import pwd
import re
import resource
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from free_ports import free_port

SSHD = Path("/usr/sbin/sshd")
INSTALL_HINT = "install openssh-server (apt-get install openssh-server)"
# sshd refuses to start without its privilege separation directory when run as root.
PRIVSEP_DIR = Path("/run/sshd")
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


@dataclass
class SshNode:
    """One sshd: the loopback address and port it listens on, and its pid."""

    address: str
    port: int
    pid: int
    alias: str = ""
    """A host name only the cluster's ssh_config knows (``node1``, ...): HostName is `address`."""


@dataclass
class SshCluster:
    """The nodes started together, their folder, and the ssh_config that reaches them."""

    nodes: list[SshNode]
    folder: Path
    ssh_config: Path
    _processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def ssh_args(self) -> str:
        """What a user passes to ``--ssh_args`` to use this cluster's ssh_config."""
        return f"-F {shlex.quote(str(self.ssh_config))}"

    @property
    def addresses(self) -> list[str]:
        return [node.address for node in self.nodes]

    def hostfile(self, slots: int = 2, path: Path | None = None) -> Path:
        """Writes a DeepSpeed-style hostfile listing every node with `slots` slots."""
        path = path or self.folder / "hostfile"
        path.write_text("".join(f"{node.address} slots={slots}\n" for node in self.nodes))
        return path


def require_sshd() -> Path:
    """The sshd binary; RuntimeError saying what to install when it is missing."""
    if not SSHD.is_file():
        raise RuntimeError(f"{SSHD} not found: {INSTALL_HINT}")
    return SSHD


def openssh_version() -> tuple[int, int]:
    """(major, minor) of the installed sshd, e.g. (9, 2)."""
    # `sshd -V` prints the version (older releases print it in their usage text); rc varies.
    probe = subprocess.run([str(require_sshd()), "-V"], capture_output=True, text=True, timeout=10)
    found = re.search(r"OpenSSH_(\d+)\.(\d+)", probe.stdout + probe.stderr)
    if not found:
        raise RuntimeError(f"cannot read the OpenSSH version from `{SSHD} -V`: {probe.stderr.strip()!r}")
    return int(found.group(1)), int(found.group(2))


def silent_tcp_server(address: str) -> tuple[socket.socket, int]:
    """A listening socket that completes TCP handshakes and never says a word.

    ssh connects, then waits for a server banner that never comes: its "timeout"
    case. The kernel accepts connections into the backlog, so no thread is needed.
    The caller closes the socket.
    """
    server = socket.socket()
    server.bind((address, 0))
    server.listen(64)
    return server, server.getsockname()[1]


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids whose environment holds ``NAME=VALUE``, this process excluded.

    Processes whose /proc/PID/environ cannot be read (another user's, or gone
    meanwhile) are skipped; a zombie's environment reads empty, so it never matches.
    """
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def _config_value(value: object) -> str:
    # sshd_config and ssh_config split arguments on spaces unless they are double-quoted.
    text = str(value)
    return f'"{text}"' if any(c.isspace() for c in text) else text


def _keygen(path: Path) -> None:
    if not path.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "zerotrain-test", "-f", str(path)],
            check=True, capture_output=True, timeout=30,
        )


def _sshd_config(folder: Path, address: str, port: int, env: Mapping[str, str], version: tuple[int, int]) -> str:
    lines = [
        f"ListenAddress {address}:{port}",
        f"HostKey {_config_value(folder / 'host_key')}",
        f"PidFile {_config_value(folder / f'sshd-{address}.pid')}",
        f"AuthorizedKeysFile {_config_value(folder / 'authorized_keys')}",
        "StrictModes no",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PermitUserEnvironment no",
        # Tests open ~10 connections at once; the defaults (10:30:100) start dropping some.
        "MaxStartups 100:30:200",
        "MaxSessions 100",
        "PrintMotd no",
        "LogLevel VERBOSE",
    ]
    if version >= (9, 8):
        # Newer sshd penalises addresses that fail to log in; auth-failure tests would
        # then lock 127.0.0.1 out of every later test.
        lines.append("PerSourcePenalties no")
    if env:
        if version < (8, 7):
            raise RuntimeError(f"set_env needs sshd's SetEnv, OpenSSH 8.7 or newer; this is {version[0]}.{version[1]}")
        lines.append("SetEnv " + " ".join(_config_value(f"{k}={v}") for k, v in env.items()))
    return "\n".join(lines) + "\n"


def _ssh_config(folder: Path, nodes: Sequence[SshNode]) -> str:
    common = [
        f"    IdentityFile {_config_value(folder / 'client_key')}",
        "    IdentitiesOnly yes",
        f"    User {pwd.getpwuid(os.getuid()).pw_name}",
        f"    UserKnownHostsFile {_config_value(folder / 'known_hosts')}",
        "    GlobalKnownHostsFile /dev/null",
        "    StrictHostKeyChecking no",
        "    LogLevel ERROR",
    ]
    blocks = []
    for node in nodes:
        blocks.append("\n".join([f"Host {node.address}", f"    Port {node.port}", *common]))
        blocks.append("\n".join([f"Host {node.alias}", f"    HostName {node.address}", f"    Port {node.port}", *common]))
    return "\n\n".join(blocks) + "\n"


def _lowered_nofile(limit: int):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_until_listening(process: subprocess.Popen, address: str, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd for {address}:{port} exited with {process.returncode}:\n{_log_tail(log)}")
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd for {address}:{port} did not listen within {START_TIMEOUT_S} s:\n{_log_tail(log)}")


def _start_sshd(folder: Path, address: str, env: Mapping[str, str], nofile: int | None,
                version: tuple[int, int]) -> tuple[subprocess.Popen, int]:
    log = folder / f"sshd-{address}.log"
    # The port is free when probed but could be taken before sshd binds it: retry then.
    for attempt in range(3):
        port = free_port(address)
        config = folder / f"sshd_config-{address}"
        config.write_text(_sshd_config(folder, address, port, env, version))
        with log.open("a") as log_file:
            process = subprocess.Popen(
                [str(SSHD), "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                preexec_fn=_lowered_nofile(nofile) if nofile is not None else None,
            )
        try:
            _wait_until_listening(process, address, port, log)
            return process, port
        except RuntimeError:
            _stop_processes([process])
            if attempt == 2 or "Cannot bind" not in _log_tail(log):
                raise
    raise AssertionError("unreachable")


def _check_login(cluster: SshCluster) -> None:
    # A broken fixture (locked account, bad key permissions) should fail here, with
    # sshd's log, rather than as a puzzling "Permission denied" in the test itself.
    for node in cluster.nodes:
        result = subprocess.run(
            ["ssh", "-F", str(cluster.ssh_config), "-T", "-o", "BatchMode=yes", node.address, "true"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
        )
        if result.returncode != 0:
            log = cluster.folder / f"sshd-{node.address}.log"
            raise RuntimeError(
                f"test sshd on {node.address}:{node.port} does not let {pwd.getpwuid(os.getuid()).pw_name} in "
                f"(ssh said: {result.stderr.strip()!r}); its log:\n{_log_tail(log)}"
            )


def start_ssh_nodes(
    folder: Path,
    addresses: Sequence[str],
    *,
    nofile_limit: Mapping[str, int] = {},  # noqa: B006 - read only
    set_env: Mapping[str, Mapping[str, str]] = {},  # noqa: B006 - read only
) -> SshCluster:
    """Starts one sshd per loopback address and checks that ssh logs in to each.

    `nofile_limit` maps an address to the RLIMIT_NOFILE (soft and hard) its sshd, and so
    every session on it, runs with. `set_env` maps an address to variables its sshd sets
    in every session (sshd's SetEnv). Nodes are named ``node1``, ``node2``, ... in the
    ssh_config, in `addresses` order. Stop them with `stop_ssh_nodes`.
    """
    require_sshd()
    unknown = (set(nofile_limit) | set(set_env)) - set(addresses)
    if unknown:
        raise ValueError(f"nofile_limit/set_env name addresses that are not started: {sorted(unknown)}")
    if os.geteuid() == 0:
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    _keygen(folder / "host_key")
    _keygen(folder / "client_key")
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    version = openssh_version()

    cluster = SshCluster(nodes=[], folder=folder, ssh_config=folder / "ssh_config")
    try:
        for index, address in enumerate(addresses, start=1):
            process, port = _start_sshd(folder, address, set_env.get(address, {}), nofile_limit.get(address), version)
            cluster._processes.append(process)
            cluster.nodes.append(SshNode(address, port, process.pid, alias=f"node{index}"))
        cluster.ssh_config.write_text(_ssh_config(folder, cluster.nodes))
        cluster.ssh_config.chmod(0o600)
        _check_login(cluster)
    except BaseException:
        stop_ssh_nodes(cluster)
        raise
    return cluster


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name before it may hold spaces, hence rsplit on ')'.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> list[int]:
    children = _children_by_parent()
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _signal(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_processes(processes: Sequence[subprocess.Popen]) -> None:
    # Sessions a test left running (a node agent, a sleep) are the daemon's descendants:
    # found before the daemon goes, since they are re-parented afterwards.
    sessions = [pid for process in processes for pid in _descendants(process.pid)]
    _signal([process.pid for process in processes] + sessions, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    while any(_alive(pid) for pid in sessions) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal([pid for pid in sessions if _alive(pid)], signal.SIGKILL)


def stop_ssh_nodes(cluster: SshCluster) -> None:
    """Stops the cluster's sshd processes and the sessions still running under them.

    By pid: SIGTERM, up to 5 s for them to go, then SIGKILL. Safe to call twice.
    """
    processes = [process for process in cluster._processes if process.poll() is None]
    _stop_processes(processes)
    # A cluster rebuilt without its Popen objects still has the pids.
    known = {process.pid for process in cluster._processes}
    orphans = [node.pid for node in cluster.nodes if node.pid not in known and _alive(node.pid)]
    if orphans:
        _signal(orphans, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(pid) for pid in orphans) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal([pid for pid in orphans if _alive(pid)], signal.SIGKILL)
