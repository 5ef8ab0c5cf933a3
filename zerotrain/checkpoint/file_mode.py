"""The mode for files the checkpoint code writes: the one any file the user writes gets.

safetensors' `save_file` creates its file 0o600, so weights written with it are chmod-ed to
`default_file_mode()` (0o644 under the usual umask 022). Files made with `open()`
(`write_text`, `shutil.copyfile`) get that mode already.
"""

from __future__ import annotations

import os


def default_file_mode() -> int:
    """The mode a new file gets from `open()` here: 0o666 less the umask."""
    try:
        with open("/proc/self/status") as f:  # read without changing it (Linux 4.7+)
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)  # no other portable way to read it: set, then put it back at once
    os.umask(umask)
    return 0o666 & ~umask
