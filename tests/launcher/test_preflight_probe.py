"""Pre-flight checks of `zerotrain launch`: the probe itself, run locally.

The tests run preflight_probe.py on this machine as the launcher runs it remotely
(source on stdin) and read the answer it prints.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from zerotrain.launcher.preflight import parse_probe_output, probe_command, probe_source

from .preflight_fixtures import free_port


def run_probe(tmp_path: Path, role: str, port: int, target="train.py", kind="script", cwd=None,
              peers=1, window_s=5.0, token="t0k3n") -> subprocess.Popen:
    params = {"cwd": str(cwd or tmp_path), "target": target, "target_kind": kind, "role": role,
              "master_addr": "127.0.0.1", "master_port": port, "peers": peers, "window_s": window_s, "token": token}
    proc = subprocess.Popen(["/bin/sh", "-c", probe_command(sys.executable)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(probe_source(params))
    proc.stdin.close()
    return proc


def probe_answer(proc: subprocess.Popen) -> dict:
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    found = parse_probe_output(out)
    assert found is not None, out
    return found


def test_probe_reports_this_python_and_node_0_answers_node_1(tmp_path):
    (tmp_path / "train.py").write_text("")
    port = free_port()
    start = time.monotonic()
    listener = run_probe(tmp_path, "listen", port, window_s=90.0)
    connector = run_probe(tmp_path, "connect", port, window_s=90.0)
    node0, node1 = probe_answer(listener), probe_answer(connector)
    # Both return as soon as the connection is made, far inside the 90 s window (a loaded
    # machine takes seconds just to start the two interpreters, so the bound is loose).
    assert time.monotonic() - start < 45
    assert node0["port"] == {"role": "listen", "ok": True, "accepted": 1}
    assert node1["port"] == {"role": "connect", "ok": True}
    expected_python = "%d.%d.%d" % sys.version_info[:3]
    assert node1["python"] == expected_python and node1["cwd_exists"] and node1["target_present"]
    import importlib.metadata

    assert node1["torch"] == importlib.metadata.version("torch")
    assert node1["zerotrain"] == importlib.metadata.version("zerotrain")
    assert len(node1["nofile"]) == 2 and len(node1["memlock"]) == 2 and node1["gpus"] >= 0


def test_probe_finds_missing_script_module_program_and_cwd(tmp_path):
    (tmp_path / "localpkg").mkdir()
    (tmp_path / "localpkg" / "__init__.py").write_text("raise SystemExit('must not be imported')")
    cases = [("nope.py", "script", False), ("localpkg.sub", "module", True), ("no_such_mod_xyz", "module", False),
             ("sh", "program", True), ("no-such-program-xyz", "program", False)]
    for target, kind, present in cases:
        found = probe_answer(run_probe(tmp_path, "listen", 0, target=target, kind=kind, peers=0))
        assert found["target_present"] is present, (target, kind)
    gone = probe_answer(run_probe(tmp_path, "listen", 0, cwd=tmp_path / "gone", peers=0))
    assert gone["cwd_exists"] is False and gone["target_present"] is None


def test_probe_on_node_0_reports_a_busy_port(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        found = probe_answer(run_probe(tmp_path, "listen", port))
    assert found["port"]["ok"] is False and "in use" in found["port"]["error"]


def test_probe_tells_a_foreign_listener_and_an_absent_one_apart(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        other.settimeout(5)
        proc = run_probe(tmp_path, "connect", other.getsockname()[1])
        conn, _ = other.accept()
        conn.sendall(b"HTTP/1.0 400 Bad Request\n")
        found = probe_answer(proc)
        conn.close()
    assert found["port"]["ok"] is False and found["port"]["foreign"] is True
    start = time.monotonic()
    absent = probe_answer(run_probe(tmp_path, "connect", free_port(), window_s=1.0))
    assert absent["port"] == {"role": "connect", "ok": False, "error": "Connection refused"}
    assert time.monotonic() - start < 25  # retries stop when the 1 s window ends (loose: start-up on a loaded machine)
