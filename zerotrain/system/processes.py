"""Whether a process runs: the one check for pid files and for temporary files named by their writer's pid."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def process_state(pid: int) -> str | None:
    """The process's state letter as `ps` shows it ("R", "S", "T" stopped, "Z" zombie, ...), or None
    when it cannot be read (no such process, or no way to ask on this system)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():  # Linux: read it directly, no process started
        try:
            # The command name in parentheses may hold spaces or ")": the state follows the last ")".
            return stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None
    try:  # macOS and other systems without /proc
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip()[:1] or None


def process_alive(pid: int) -> bool:
    """True while `pid` runs on this machine. A zombie (exited, not yet reaped by its parent) counts as
    dead, though `kill(pid, 0)` still finds it: a detached run's parent exits at once, so its exited
    process may linger unreaped. Another user's process counts as alive."""
    if pid <= 0:
        return False  # kill(0 or -N, 0) would ask about process groups, not a process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    return process_state(pid) != "Z"
