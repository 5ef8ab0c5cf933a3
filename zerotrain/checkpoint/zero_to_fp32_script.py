"""The `zero_to_fp32.py` placed in every checkpoint folder, as DeepSpeed places its own.

Users (and scripts written for DeepSpeed) run `python zero_to_fp32.py . OUTPUT_DIR` inside
a checkpoint folder to get the fp32 weights out. The file is a few lines that hand over
to zerotrain.checkpoint.zero_to_fp32.main, so it never goes stale against the format.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from zerotrain.checkpoint.file_mode import default_file_mode
from zerotrain.system.durable_files import atomic_write_text

SCRIPT_NAME = "zero_to_fp32.py"

SCRIPT_TEXT = '''\
#!/usr/bin/env python
"""Writes the fp32 weights of the zerotrain checkpoints in this folder (DeepSpeed's zero_to_fp32.py arguments).

    python zero_to_fp32.py . output_dir/                        # pytorch_model.bin
    python zero_to_fp32.py . output_dir/ --safe_serialization   # model.safetensors
    python zero_to_fp32.py --help

Written here by zerotrain when it saved a checkpoint; the work is done by zerotrain itself.
"""

import sys

TRAINED_WITH = __TRAINED_WITH__  # the Python that wrote these checkpoints

try:
    from zerotrain.checkpoint.zero_to_fp32 import main
except ImportError as error:
    sys.exit(
        "zero_to_fp32.py: error: this Python cannot import zerotrain, which wrote these checkpoints "
        f"and reads them ({error}). Run this with the Python that trained the model: {TRAINED_WITH} "
        "zero_to_fp32.py ... , or install zerotrain into this environment the way it was installed "
        "there (from a checkout: pip install -e <checkout>)."
    )

if __name__ == "__main__":
    sys.exit(main())
'''


def write_zero_to_fp32_script(save_dir: str | os.PathLike) -> Path:
    """Writes SAVE_DIR/zero_to_fp32.py, executable, replacing any older copy whole; returns its path."""
    path = Path(save_dir) / SCRIPT_NAME
    mode = default_file_mode()
    # This interpreter, shell-quoted for pasting, as a Python literal (repr) in the script; the file
    # executable by whoever may read it (0o755 under umask 022).
    atomic_write_text(path, SCRIPT_TEXT.replace("__TRAINED_WITH__", repr(shlex.quote(sys.executable)), 1),
                      mode=mode | (mode & 0o444) >> 2)
    return path
