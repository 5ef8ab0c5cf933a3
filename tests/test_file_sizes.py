"""No Python file of the package grows past 400 lines: past that a file holds more than one concept
(split it along a seam, one concept per file)."""

from __future__ import annotations

from pathlib import Path

import zerotrain

MAX_LINES = 400
PACKAGE = Path(zerotrain.__file__).parent


def test_no_file_in_the_package_is_over_400_lines():
    lengths = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in sorted(PACKAGE.rglob("*.py"))}
    assert lengths, f"no .py files found under {PACKAGE}"
    too_long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]
    assert not too_long, f"over {MAX_LINES} lines (split each along a seam):\n  " + "\n  ".join(too_long)
