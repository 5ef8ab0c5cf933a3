"""The ssh layer of the multi-node launcher: command lines, failure diagnosis, parallel runs.

We call the system's OpenSSH client rather than a Python ssh library, so everything a
user already set up for ssh (~/.ssh/config, keys, agents, jump hosts, the ``-F`` file
they pass in ``--ssh_args``) works unchanged.

Option order matters: for each option ssh keeps the FIRST value it is given, and all
command-line options come before any config file. So the command line is built as

    ssh -T -o BatchMode=yes [-p PORT] <user's --ssh_args> -o ConnectTimeout=N HOST CMD

- ``BatchMode=yes`` first: a launcher must never sit at a password prompt, whatever
  the user's options say.
- ``-p`` from ``--ssh_port`` next: the dedicated flag beats a ``-p`` inside ``--ssh_args``
  and the config file's ``Port``.
- the user's ``--ssh_args`` before our remaining defaults, so e.g. their
  ``-o ConnectTimeout=60`` wins over ours; anything neither sets comes from the config.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from zerotrain.launcher.local import LaunchError

# OpenSSH exits 255 when ssh itself failed; any other status is the remote command's.
SSH_FAILED = 255
DEFAULT_CONNECT_TIMEOUT_S = 10
# Appended to the stderr of a host that `run_on_hosts` stopped for running too long.
RUN_TIMEOUT_NOTE = "zerotrain: stopped ssh after"


class SshError(LaunchError):
    """ssh could not be started, or could not read its own configuration."""


@dataclass(frozen=True)
class SshOptions:
    """How the launcher runs ssh: the user's ``--ssh_port`` and ``--ssh_args``."""

    port: int | None = None
    """``--ssh_port``: overrides the port in the user's ssh config."""
    extra_args: tuple[str, ...] = ()
    """``shlex.split(--ssh_args)``, e.g. ``("-F", "my_config", "-i", "key")``."""
    connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S
    """ConnectTimeout: how long to wait for the TCP connection and the server's banner."""


def _option_args(options: SshOptions) -> list[str]:
    # See the module docstring for why this order.
    args = ["-o", "BatchMode=yes"]
    if options.port is not None:
        args += ["-p", str(options.port)]
    args += list(options.extra_args)
    args += ["-o", f"ConnectTimeout={options.connect_timeout_s}"]
    return args


def ssh_argv(host: str, remote_command: str, options: SshOptions) -> list[str]:
    """The argv that runs `remote_command` on `host`, without a terminal or prompts.

    The remote side hands `remote_command` to the user's login shell as one string:
    quote every value in it with ``shlex.quote`` (or build it with ``shlex.join``).
    """
    return ["ssh", "-T", *_option_args(options), "--", host, remote_command]  # "--": a host is never an option


def _run_ssh(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, **kwargs)
    except FileNotFoundError as error:
        raise SshError("ssh not found: install the OpenSSH client (apt-get install openssh-client)") from error


def resolved_address(host: str, options: SshOptions) -> str:
    """The host name or address ssh would connect to for `host`, after its config.

    Asks ``ssh -G``, which applies ~/.ssh/config or the ``-F`` file in `options`
    (``HostName`` aliases, ``Match`` blocks) and prints the result without connecting.
    """
    try:
        result = _run_ssh(
            ["ssh", "-G", *_option_args(options), "--", host],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
        )
    except subprocess.TimeoutExpired as error:
        raise SshError(f"`ssh -G {host}` did not finish within 30 s: check the Match exec lines of your ssh config") from error
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value
    problem = _last_line(result.stderr) or f"exit status {result.returncode}"
    raise SshError(
        f"cannot read ssh's configuration for host {host!r}: {problem}: check --ssh_args and ~/.ssh/config"
    )


@dataclass(frozen=True)
class SshFailure:
    """Why ssh to a host failed, as a kind tests and callers can branch on, and a line for the user."""

    kind: str
    """One of "refused", "timeout", "auth", "dns", "host-key", "unreachable", "other"."""
    message: str
    """One line: what happened, on which host, and how to fix it."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.replace("\r", "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _line_with(text: str, needle: str) -> str:
    for line in text.replace("\r", "").splitlines():
        if needle.lower() in line.lower():
            return line.strip()
    return ""


def _on_port(text: str) -> str:
    # OpenSSH names the port in "connect to host H port P: ..." and "Connection to H port P timed out".
    found = re.search(r"\bport (\d+)", text)
    return f" on port {found.group(1)}" if found else ""


def classify_ssh_failure(host: str, returncode: int, stderr: str) -> SshFailure | None:
    """What went wrong when ``ssh HOST ...`` exited with `returncode` and printed `stderr`.

    None when `returncode` is not 255: ssh connected and that status is the remote
    command's own. (A remote command that itself exits 255 cannot be told apart
    from an ssh failure; it is reported as "other" with its last stderr line.)
    Recognises OpenSSH's messages, and the note `run_on_hosts` adds to a host it stopped.
    """
    if returncode != SSH_FAILED:
        return None
    text = stderr.replace("\r", "")
    lower = text.lower()

    if RUN_TIMEOUT_NOTE in text:
        note = _line_with(text, RUN_TIMEOUT_NOTE).removeprefix("zerotrain: ")
        return SshFailure("timeout", f"ssh to {host}: {note}: the command may be stuck there, the node "
                                     "overloaded, or the connection lost")
    if "could not resolve hostname" in lower or "name or service not known" in lower \
            or "nodename nor servname" in lower or "temporary failure in name resolution" in lower:
        return SshFailure("dns", f"ssh to {host}: the host name could not be resolved: check its spelling in the "
                                 "hostfile, or give it a Host entry with a HostName in ~/.ssh/config "
                                 "(or in the -F file passed with --ssh_args)")
    if "host key verification failed" in lower or "remote host identification has changed" in lower:
        remove = _line_with(text, "ssh-keygen")
        if remove:
            return SshFailure("host-key", f"ssh to {host}: the host's key has changed since it was recorded in "
                                          f"known_hosts; if the node was reinstalled, remove the old key with "
                                          f"`{remove}` and connect once by hand to accept the new one")
        return SshFailure("host-key", f"ssh to {host}: host key verification failed: the host's key is not in "
                                      f"known_hosts; connect once by hand (ssh {host}) to check and accept it, "
                                      "then launch again")
    if "permission denied" in lower or "too many authentication failures" in lower:
        denied = _line_with(text, "permission denied") or _line_with(text, "too many authentication failures")
        user = re.match(r"(\S+)@\S+: permission denied", denied, re.IGNORECASE)
        who = f" as {user.group(1)}" if user else ""
        return SshFailure("auth", f"ssh to {host}: permission denied{who} ({denied}): set up key authentication "
                                  f"(ssh-copy-id {host}), or pass the key with --ssh_args \"-i PATH\"; "
                                  "the launcher cannot answer password prompts")
    if "connection refused" in lower:
        return SshFailure("refused", f"ssh to {host}: connection refused{_on_port(text)}: is sshd running there, "
                                     "and is the port right (--ssh_port)?")
    if "timed out during banner exchange" in lower:
        return SshFailure("timeout", f"ssh to {host}: the connection{_on_port(text)} was accepted but no ssh server "
                                     "answered in time: is sshd there overloaded, or is that port another "
                                     "service (--ssh_port)?")
    if "timed out" in lower:
        return SshFailure("timeout", f"ssh to {host}: connection timed out{_on_port(text)}: is the host up, is the "
                                     "address right, and does its firewall let ssh through?")
    if "no route to host" in lower or "network is unreachable" in lower:
        line = _line_with(text, "no route to host") or _line_with(text, "network is unreachable")
        reason = "no route to host" if "no route" in line.lower() else "network is unreachable"
        return SshFailure("unreachable", f"ssh to {host}: {reason}: check the address in the hostfile, that the "
                                         "node is up, and this machine's network and firewall")
    if "kex_exchange_identification" in lower or "connection reset by peer" in lower:
        return SshFailure("other", f"ssh to {host}: the server closed the connection before logging in "
                                   f"({_last_line(text)}): too many connections at once (sshd's MaxStartups), "
                                   "or a firewall or TCP wrapper rejecting this machine")
    if "closed by remote host" in lower:
        return SshFailure("other", f"ssh to {host}: the connection was closed while the command ran: the node "
                                   "may have rebooted, or sshd or the network went down")
    last = _last_line(text)
    if last:
        return SshFailure("other", f"ssh to {host} failed (exit status 255): {last}")
    return SshFailure("other", f"ssh to {host} failed with exit status 255 and no message: run "
                               f"`ssh -v {host} true` to see why")


def run_on_hosts(
    hosts: Sequence[str],
    remote_command: str,
    options: SshOptions,
    *,
    stdin_text: str = "",
    timeout_s: float = 60,
) -> dict[str, subprocess.CompletedProcess]:
    """Runs `remote_command` over ssh on every host at once; returns each host's result.

    Every host gets `stdin_text` on its stdin, then end of file. Results hold stdout and
    stderr as text, keyed by host in `hosts` order. A host still running after
    `timeout_s` seconds (counted from the start, for all hosts together) has its ssh
    killed: its result gets returncode 255 and a last stderr line starting with
    ``RUN_TIMEOUT_NOTE``, which `classify_ssh_failure` reports as a "timeout".
    Killing ssh closes the remote command's stdin, but with no terminal (-T) it
    sends the remote command no signal.
    """
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"run_on_hosts: hosts repeat: {list(hosts)}")
    processes: dict[str, subprocess.Popen] = {}
    results: dict[str, subprocess.CompletedProcess] = {}
    deadline = time.monotonic() + timeout_s

    def communicate(host: str, process: subprocess.Popen) -> None:
        try:
            stdout, stderr = process.communicate(stdin_text, timeout=max(0.0, deadline - time.monotonic()))
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            process.kill()  # the ssh client we started, by its own pid
            stdout, stderr = process.communicate()
            stderr = (stderr or "") + f"\n{RUN_TIMEOUT_NOTE} {timeout_s:g} s: the command on {host} had not finished\n"
            returncode = SSH_FAILED
        results[host] = subprocess.CompletedProcess(process.args, returncode, stdout or "", stderr or "")

    try:
        for host in hosts:
            argv = ssh_argv(host, remote_command, options)
            try:
                processes[host] = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
            except FileNotFoundError as error:
                raise SshError("ssh not found: install the OpenSSH client (apt-get install openssh-client)") from error
        threads = [threading.Thread(target=communicate, args=item, daemon=True) for item in processes.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        # Interrupted (Ctrl-C) or failed to start one: leave no ssh running behind us.
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return {host: results[host] for host in hosts}
