"""The ssh layer against real sshd servers on loopback addresses (tests/launcher/sshd_nodes.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid

import pytest

from zerotrain.launcher.local import LaunchError
from zerotrain.launcher.ssh import (
    SshOptions,
    classify_ssh_failure,
    resolved_address,
    run_on_hosts,
    ssh_argv,
)

from .sshd_nodes import free_port, processes_with_env, silent_tcp_server


def cluster_options(cluster, **settings) -> SshOptions:
    return SshOptions(extra_args=tuple(shlex.split(cluster.ssh_args)), **settings)


def run_ssh(argv: list[str], stdin_text: str = "", timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin_text, capture_output=True, text=True, timeout=timeout)


def server_address_of_session(result: subprocess.CompletedProcess) -> str:
    # SSH_CONNECTION is "client_ip client_port server_ip server_port": which node answered.
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[2]


def test_ssh_argv_runs_a_command_on_each_node(ssh_cluster):
    options = cluster_options(ssh_cluster)
    for node in ssh_cluster.nodes:
        result = run_ssh(ssh_argv(node.address, "echo $SSH_CONNECTION", options))
        assert server_address_of_session(result) == node.address


def test_ssh_argv_reaches_a_node_through_its_ssh_config_alias(ssh_cluster):
    options = cluster_options(ssh_cluster)
    for node in ssh_cluster.nodes:
        result = run_ssh(ssh_argv(node.alias, "echo $SSH_CONNECTION", options))
        assert server_address_of_session(result) == node.address


def test_stdin_reaches_the_remote_command(ssh_cluster):
    text = "first line\nsecond line with 'quotes' and $DOLLAR\n"
    result = run_ssh(ssh_argv(ssh_cluster.nodes[0].address, "cat", cluster_options(ssh_cluster)), stdin_text=text)
    assert result.returncode == 0, result.stderr
    assert result.stdout == text


def test_shell_quoted_values_arrive_unchanged_as_remote_argv(ssh_cluster):
    values = ["two words", "it's", 'say "hi"', "$HOME", "a;b", "`id`", "*", "", "back\\slash", "x|y&z", "ünïcode"]
    code = "import json, sys; print(json.dumps(sys.argv[1:]))"
    remote = shlex.join([sys.executable, "-c", code, *values])
    result = run_ssh(ssh_argv(ssh_cluster.nodes[1].address, remote, cluster_options(ssh_cluster)))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == values


def test_remote_exit_status_comes_back_and_is_not_an_ssh_failure(ssh_cluster):
    result = run_ssh(ssh_argv(ssh_cluster.nodes[0].address, "exit 3", cluster_options(ssh_cluster)))
    assert result.returncode == 3
    assert classify_ssh_failure(ssh_cluster.nodes[0].address, result.returncode, result.stderr) is None


def effective_ssh_settings(argv: list[str]) -> dict[str, str]:
    """What ssh would use for the connection `argv` describes, from `ssh -G` (no connection)."""
    assert argv[0] == "ssh" and argv[1] == "-T"
    printed = subprocess.run(["ssh", "-G", *argv[2:-1]], capture_output=True, text=True, timeout=30, check=True)
    return dict(line.split(" ", 1) for line in printed.stdout.splitlines() if " " in line)


def test_user_options_beat_our_defaults_but_batch_mode_stays_on(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu1\n    HostName 127.0.0.9\n    Port 2200\n    User alice\n")
    user_args = ("-F", str(config), "-o", "BatchMode=no", "-o", "ConnectTimeout=45")
    settings = effective_ssh_settings(ssh_argv("gpu1", "true", SshOptions(extra_args=user_args)))
    assert settings["batchmode"] == "yes"
    assert settings["connecttimeout"] == "45"
    assert (settings["hostname"], settings["port"], settings["user"]) == ("127.0.0.9", "2200", "alice")


def test_ssh_port_beats_the_config_port_and_a_port_in_ssh_args(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu1\n    Port 2200\n")
    options = SshOptions(port=2300, extra_args=("-F", str(config), "-p", "2400"), connect_timeout_s=7)
    settings = effective_ssh_settings(ssh_argv("gpu1", "true", options))
    assert settings["port"] == "2300"
    assert settings["connecttimeout"] == "7"


def test_a_closed_port_is_classified_as_refused(ssh_cluster):
    node = ssh_cluster.nodes[0]
    closed = free_port(node.address)
    # --ssh_port must override the Port of the cluster's ssh_config for this to be refused.
    result = run_ssh(ssh_argv(node.address, "true", cluster_options(ssh_cluster, port=closed)))
    failure = classify_ssh_failure(node.address, result.returncode, result.stderr)
    assert failure is not None and failure.kind == "refused", result.stderr
    assert f"connection refused on port {closed}" in failure.message
    assert node.address in failure.message and "--ssh_port" in failure.message


@pytest.mark.slow
def test_a_port_that_never_answers_is_classified_as_timeout():
    server, port = silent_tcp_server("127.0.0.2")
    try:
        options = SshOptions(port=port, extra_args=("-F", "/dev/null"), connect_timeout_s=2)
        started = time.monotonic()
        result = run_ssh(ssh_argv("127.0.0.2", "true", options))
        elapsed = time.monotonic() - started
    finally:
        server.close()
    failure = classify_ssh_failure("127.0.0.2", result.returncode, result.stderr)
    assert failure is not None and failure.kind == "timeout", result.stderr
    assert f"port {port}" in failure.message
    assert 1.5 < elapsed < 10


def test_a_key_the_node_does_not_accept_is_classified_as_auth(ssh_cluster, tmp_path):
    node = ssh_cluster.nodes[0]
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=30)
    # No -F: only this key is offered (IdentitiesOnly), never the cluster's or an agent's.
    options = SshOptions(port=node.port, extra_args=(
        "-F", "/dev/null", "-i", str(stranger), "-o", "IdentitiesOnly=yes",
        "-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR",
    ))
    result = run_ssh(ssh_argv(node.address, "true", options))
    failure = classify_ssh_failure(node.address, result.returncode, result.stderr)
    assert failure is not None and failure.kind == "auth", result.stderr
    assert "ssh-copy-id" in failure.message and "--ssh_args" in failure.message


def test_a_changed_host_key_is_classified_as_host_key(ssh_cluster, tmp_path):
    node = ssh_cluster.nodes[0]
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30)
    key_type, key = other.with_suffix(".pub").read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[{node.address}]:{node.port} {key_type} {key}\n")
    # Our -o options come before the cluster's -F file, so they win over its "no".
    options = SshOptions(extra_args=(
        "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}", "-F", str(ssh_cluster.ssh_config),
    ))
    result = run_ssh(ssh_argv(node.address, "true", options))
    failure = classify_ssh_failure(node.address, result.returncode, result.stderr)
    assert failure is not None and failure.kind == "host-key", result.stderr
    assert "ssh-keygen" in failure.message and str(known_hosts) in failure.message


@pytest.mark.parametrize("stderr", [
    "ssh: Could not resolve hostname gpu-node-17: Name or service not known\r\n",
    "ssh: Could not resolve hostname gpu-node-17: Temporary failure in name resolution\r\n",
    "ssh: Could not resolve hostname gpu-node-17: nodename nor servname provided, or not known\r\n",
])
def test_openssh_resolver_errors_are_classified_as_dns(stderr):
    failure = classify_ssh_failure("gpu-node-17", 255, stderr)
    assert failure is not None and failure.kind == "dns"
    assert "gpu-node-17" in failure.message and "hostfile" in failure.message and "~/.ssh/config" in failure.message


@pytest.mark.parametrize(("stderr", "kind"), [
    ("ssh: connect to host 10.1.2.3 port 22: No route to host\r\n", "unreachable"),
    ("ssh: connect to host 10.1.2.3 port 22: Network is unreachable\r\n", "unreachable"),
    ("ssh: connect to host 10.1.2.3 port 22: Connection timed out\r\n", "timeout"),
    ("Received disconnect from 10.1.2.3 port 22:2: Too many authentication failures\r\n", "auth"),
    ("kex_exchange_identification: read: Connection reset by peer\r\n", "other"),
    ("Connection to 10.1.2.3 closed by remote host.\r\n", "other"),
    ("command-line: line 0: Bad configuration option: bogus\r\n", "other"),
    ("", "other"),
])
def test_other_openssh_messages_get_a_kind_and_one_line(stderr, kind):
    failure = classify_ssh_failure("gpu3", 255, stderr)
    assert failure is not None and failure.kind == kind
    assert "gpu3" in failure.message and "\n" not in failure.message


def test_a_nonzero_status_other_than_255_is_the_remote_commands_own():
    assert classify_ssh_failure("gpu3", 1, "ssh: connect to host gpu3 port 22: Connection refused") is None
    assert classify_ssh_failure("gpu3", 0, "") is None


def test_run_on_hosts_runs_the_hosts_at_the_same_time(ssh_cluster):
    # Each host prints when its command starts and ends (one clock: all nodes are this
    # machine): run one after the other, the second would start after the first ended.
    started = time.monotonic()
    results = run_on_hosts(ssh_cluster.addresses, "date +%s.%N; sleep 1; date +%s.%N", cluster_options(ssh_cluster))
    elapsed = time.monotonic() - started
    assert list(results) == ssh_cluster.addresses
    spans = []
    for result in results.values():
        assert result.returncode == 0, result.stderr
        spans.append([float(stamp) for stamp in result.stdout.split()])
    assert max(start for start, _ in spans) < min(end for _, end in spans), f"not concurrent: {spans}"
    # Usually ~1.4 s; not "< 2 s", which logins on a loaded 2-core machine overrun.
    assert elapsed < 5, f"two 1 s commands took {elapsed:.2f} s"


def test_run_on_hosts_gives_every_host_the_same_stdin(ssh_cluster):
    results = run_on_hosts(ssh_cluster.addresses, "cat", cluster_options(ssh_cluster), stdin_text="job spec\n")
    assert {address: result.stdout for address, result in results.items()} == {
        address: "job spec\n" for address in ssh_cluster.addresses
    }


def test_run_on_hosts_reports_each_host_on_its_own(ssh_cluster, tmp_path):
    # node1 and node2 are aliases only the cluster's -F file knows; "nowhere" has no entry and
    # a closed port: refused, while the others succeed.
    config = tmp_path / "ssh_config"
    closed = free_port("127.0.0.4")
    config.write_text(ssh_cluster.ssh_config.read_text() + f"\nHost nowhere\n    HostName 127.0.0.4\n    Port {closed}\n")
    results = run_on_hosts(["node1", "nowhere", "node2"], "true", SshOptions(extra_args=("-F", str(config))))
    assert [results[host].returncode for host in ("node1", "node2")] == [0, 0]
    failure = classify_ssh_failure("nowhere", results["nowhere"].returncode, results["nowhere"].stderr)
    assert failure is not None and failure.kind == "refused"


@pytest.mark.slow
def test_run_on_hosts_stops_a_host_that_runs_past_the_timeout(ssh_cluster):
    fast, slow = ssh_cluster.addresses
    command = f'if [ "$(echo $SSH_CONNECTION | cut -d" " -f3)" = {slow} ]; then sleep 8; fi; echo done'
    started = time.monotonic()
    # 3 s: ample for the fast host's login and command, however loaded the machine.
    results = run_on_hosts([fast, slow], command, cluster_options(ssh_cluster), timeout_s=3)
    elapsed = time.monotonic() - started
    assert results[fast].returncode == 0 and results[fast].stdout == "done\n"
    assert results[slow].returncode == 255
    failure = classify_ssh_failure(slow, results[slow].returncode, results[slow].stderr)
    assert failure is not None and failure.kind == "timeout"
    assert "3 s" in failure.message
    assert elapsed < 6


def test_killing_the_local_ssh_closes_the_remote_commands_stdin(ssh_cluster, tmp_path):
    # No guessed login time: the remote command echoes a line it read from stdin into a file
    # (so it is logged in, and its stdin is open and ours), then reads to the end and marks that.
    echoed, closed = tmp_path / "echoed", tmp_path / "stdin-closed"
    part = echoed.with_suffix(".part")
    code = (f"import os, sys; line = sys.stdin.readline(); open({str(part)!r}, 'w').write(line); "
            f"os.replace({str(part)!r}, {str(echoed)!r}); sys.stdin.read(); open({str(closed)!r}, 'w').close()")
    argv = ssh_argv(ssh_cluster.nodes[0].address, shlex.join([sys.executable, "-c", code]), cluster_options(ssh_cluster))
    ssh = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ssh.stdin.write("logged in\n")
        ssh.stdin.flush()
        assert wait_for_file(echoed, 30, ssh), f"no echo: ssh ended with {ssh.returncode}: {ssh.stderr.read()}"
        assert echoed.read_text() == "logged in\n"
        assert not closed.exists(), "the remote command's stdin closed while the local ssh still ran"
    finally:
        ssh.kill()
        ssh.wait()
        ssh.stdin.close()
        ssh.stderr.close()
    assert wait_for_file(closed, 10), "the remote command never saw its stdin close"


def wait_for_file(path, timeout_s: float, process: subprocess.Popen | None = None) -> bool:
    """Whether `path` appears within `timeout_s` (False at once if `process` ends first without it)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            return path.exists()
        time.sleep(0.05)
    return True


def test_resolved_address_follows_the_ssh_config_alias(ssh_cluster):
    options = cluster_options(ssh_cluster)
    assert [resolved_address(node.alias, options) for node in ssh_cluster.nodes] == ssh_cluster.addresses
    assert resolved_address("127.0.0.3", options) == "127.0.0.3"


def test_resolved_address_of_a_name_without_an_entry_is_the_name_itself():
    # ssh -G resolves nothing (no CanonicalizeHostname): no DNS query leaves the machine.
    assert resolved_address("gpu-node-17.invalid", SshOptions(extra_args=("-F", "/dev/null"))) == "gpu-node-17.invalid"


def test_resolved_address_says_when_the_ssh_config_cannot_be_read(tmp_path):
    missing = tmp_path / "no_such_config"
    with pytest.raises(LaunchError, match=r"no_such_config.*--ssh_args"):
        resolved_address("gpu1", SshOptions(extra_args=("-F", str(missing))))


def test_processes_with_env_finds_a_child_until_it_exits():
    marker = f"ZEROTRAIN_TEST_MARKER_{uuid.uuid4().hex}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, marker: "1"})
    try:
        assert processes_with_env(marker, "1") == [child.pid]
        assert processes_with_env(marker, "2") == []
    finally:
        child.kill()
        child.wait()
    assert processes_with_env(marker, "1") == []


@pytest.mark.slow
def test_nodes_can_have_a_lower_open_file_limit_and_their_own_environment(make_ssh_nodes):
    cluster = make_ssh_nodes(
        ["127.0.0.5", "127.0.0.6"],
        nofile_limit={"127.0.0.5": 256},
        set_env={"127.0.0.6": {"ZEROTRAIN_NODE_NOTE": "two words"}},
    )
    results = run_on_hosts(cluster.addresses, 'ulimit -Sn; ulimit -Hn; echo "[$ZEROTRAIN_NODE_NOTE]"',
                           cluster_options(cluster))
    low, other = (results[address].stdout.split("\n")[:3] for address in cluster.addresses)
    assert low == ["256", "256", "[]"]
    assert other[:2] != ["256", "256"] and other[2] == "[two words]"
