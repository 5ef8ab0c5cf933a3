"""What `zerotrain launch` needs to know about one node, gathered on that node in one go.

The launcher sends this file over ssh as the standard input of ``PYTHON -``, with a
first line ``PARAMS_JSON = '...'`` prepended, and reads back one line:
``ZEROTRAIN_PREFLIGHT {json}``. The marker lets the launcher pick the line out of
whatever a login script prints.

It must run wherever the job's Python runs, including on a node where zerotrain
or torch is missing or broken, so it uses the standard library only, never imports
torch or zerotrain, and keeps to syntax that Python 3.6 accepts (an old Python on a
node then shows up as a version mismatch, not as a syntax error).

Parameters (all keys required):
    cwd, target, target_kind ("script" | "module" | "program"): what the job will run, and where.
    role: "listen" on node 0, which hosts the rendezvous store; "connect" on every other node.
    master_addr, master_port: the rendezvous address.
    peers: how many nodes connect to node 0 (the listener stops waiting once all have).
    window_s: how long the listener waits for them, and the connectors keep retrying.
    token: a random string the listener sends to every connection, so a connector can tell
        node 0's listener from some other program that happens to hold the port.

Run by hand: ``python preflight_probe.py '{"cwd": ...}'``.
"""

import errno
import importlib.util
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time

MARKER = "ZEROTRAIN_PREFLIGHT "
# Seconds one connection attempt may take; a firewall that drops packets makes connect() hang.
CONNECT_ATTEMPT_S = 2.0
RETRY_PAUSE_S = 0.2


def python_version():
    return "%d.%d.%d" % tuple(sys.version_info[:3])


def distribution_version(name):
    """Installed version of distribution `name` as this Python sees it, or None."""
    try:
        import importlib.metadata as metadata
    except ImportError:  # Python < 3.8: no way to ask without third-party code
        return None
    try:
        return metadata.version(name)
    except Exception:  # noqa: BLE001 - missing, or broken metadata: both mean "not usable"
        return None


def target_present(cwd, target, kind):
    """Whether the job's script, module or program can be found from `cwd`, as the job will look."""
    if kind == "script":
        return os.path.isfile(os.path.join(cwd, target))
    if kind == "module":
        # Only the top-level name: finding a submodule would run the package's __init__.
        top_level = target.split(".")[0]
        sys.path.insert(0, cwd)  # `python -m` puts the working directory first
        try:
            return importlib.util.find_spec(top_level) is not None
        except (ImportError, ValueError):
            return False
        finally:
            sys.path.remove(cwd)
    return shutil.which(target) is not None


def gpu_count():
    """Number of NVIDIA GPUs on this machine, found without loading CUDA (0 when none or no driver)."""
    proc_dir = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc_dir):
        return len(os.listdir(proc_dir))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.decode(errors="replace").splitlines() if line.startswith("GPU "))


def limit(which):
    """[soft, hard] of a resource limit; None stands for unlimited."""
    soft, hard = resource.getrlimit(which)
    return [None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]


def listen(port, window_s, peers, token, result):
    """Node 0: binds the rendezvous port as the store will, then answers `peers` connections."""
    try:
        sock = _bound_socket(port)
        sock.listen(max(16, peers))
    except OSError as error:
        result.update(ok=False, error=error.strerror or str(error))
        return None
    result.update(ok=True, accepted=0)
    thread = threading.Thread(target=_accept, args=(sock, window_s, peers, token, result), daemon=True)
    thread.start()
    return thread


def _bound_socket(port):
    """A socket bound to `port` on every address: IPv4 and IPv6 where the node has IPv6, else IPv4 only."""
    families = [socket.AF_INET6, socket.AF_INET] if socket.has_ipv6 else [socket.AF_INET]
    for family in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is not "busy"
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 peers too
            sock.bind(("::" if family == socket.AF_INET6 else "", port))
            return sock
        except OSError as error:
            sock.close()
            # Busy or forbidden is the answer; anything else (IPv6 switched off) means: try IPv4.
            if family == families[-1] or error.errno in (errno.EADDRINUSE, errno.EACCES):
                raise
    raise OSError(errno.EAFNOSUPPORT, "no usable address family")


def _accept(sock, window_s, peers, token, result):
    deadline = time.monotonic() + window_s
    try:
        while result["accepted"] < peers:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                break
            with conn:
                try:
                    conn.sendall((token + "\n").encode())
                except OSError:
                    continue
            result["accepted"] += 1
    finally:
        sock.close()


def connect(addr, port, window_s, token, result):
    """Any other node: reaches node 0's listener at addr:port, retrying until it answers or time is up."""
    deadline = time.monotonic() + window_s
    error = "no attempt"
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=CONNECT_ATTEMPT_S)
        except socket.gaierror as exc:
            # A name that does not resolve will not resolve on a retry either.
            result.update(ok=False, error="cannot resolve %s: %s" % (addr, exc.strerror or exc))
            return
        except socket.timeout:
            error = "timed out"
        except OSError as exc:
            error = exc.strerror or str(exc)
        else:
            # Connected: node 0's listener answers at once; silence or anything else is another program.
            if _read_line(conn) == token:
                result.update(ok=True)
            else:
                result.update(ok=False, error="answered, but not by node 0's pre-flight check", foreign=True)
            return
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            result.update(ok=False, error=error)
            return
        time.sleep(RETRY_PAUSE_S)


def _read_line(conn):
    """The first line `conn` sends within CONNECT_ATTEMPT_S, or None; closes `conn`."""
    answer = b""
    try:
        with conn:
            conn.settimeout(CONNECT_ATTEMPT_S)
            while not answer.endswith(b"\n") and len(answer) < 256:
                chunk = conn.recv(256)
                if not chunk:
                    break
                answer += chunk
    except OSError:
        return None
    return answer.decode(errors="replace").strip()


def probe(params):
    """Everything the launcher judges, as one JSON-ready dict."""
    port = {"role": params["role"]}
    thread = None
    # The port check starts first and runs while the rest is gathered, so it costs no extra time.
    if params["role"] == "listen":
        thread = listen(params["master_port"], params["window_s"], params["peers"], params["token"], port)
    else:
        thread = threading.Thread(
            target=connect,
            args=(params["master_addr"], params["master_port"], params["window_s"], params["token"], port),
            daemon=True,
        )
        thread.start()

    # `python -` puts the login directory first on sys.path; versions are those installed in this Python.
    sys.path[:] = [entry for entry in sys.path if entry not in ("", ".")]
    cwd = params["cwd"]
    cwd_exists = os.path.isdir(cwd)
    if cwd_exists:
        os.chdir(cwd)  # a relative program path or PATH entry resolves as it will for the job
    facts = {
        "python": python_version(),
        "executable": sys.executable,
        "hostname": platform.node(),
        "cwd_exists": cwd_exists,
        "target_present": target_present(cwd, params["target"], params["target_kind"]) if cwd_exists else None,
        "torch": distribution_version("torch"),
        "zerotrain": distribution_version("zerotrain"),
        "gpus": gpu_count(),
        "nofile": limit(resource.RLIMIT_NOFILE),
        "memlock": limit(resource.RLIMIT_MEMLOCK),
    }
    if thread is not None:
        thread.join()
    facts["port"] = port
    return facts


def main():
    params = json.loads(globals().get("PARAMS_JSON") or sys.argv[1])
    sys.stdout.write(MARKER + json.dumps(probe(params)) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
