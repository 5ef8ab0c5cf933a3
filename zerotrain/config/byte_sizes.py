"""Sizes a user writes ("80GiB", "5GB", "500MB", "1.5TiB", 123) read into bytes, and bytes written back.

One rule for every command that takes a size (`plan`/`estimate`/`init`'s --gpu-memory and
--cpu-memory, `consolidate`'s and zero_to_fp32's --max-shard-size):

- SI units are decimal: kB/KB, MB, GB, TB = 10^3, 10^6, 10^9, 10^12 bytes, as Hugging Face and
  DeepSpeed read ``max_shard_size="5GB"`` (so their shard files and ours split alike);
- binary units are written out: KiB, MiB, GiB, TiB = 2^10, 2^20, 2^30, 2^40 bytes;
- B or no unit: bytes. Units are case-insensitive and a "b" is always bytes (no sizes in bits).
- A bare K, M, G or T is refused: tools disagree on it (nccl-tests and `ls -h` read 2^30, disks
  10^9), so the error asks for GB or GiB.

A GPU's memory is counted in GiB: an "80GB" H100 holds about 80 GiB (nvidia-smi's 81559 MiB),
which is 85.9e9 bytes, not 80e9. So the planners' examples write 80GiB, and 80GB means 80e9.
"""

from __future__ import annotations

import re

DECIMAL_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
UNITS = {"": 1, "b": 1, **DECIMAL_UNITS, **BINARY_UNITS}

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*")
_GIB = 2**30
# A unit letter without B or iB: (its decimal power, its binary power), for the error's two readings.
_BARE_LETTERS = {"k": (3, 10), "m": (6, 20), "g": (9, 30), "t": (12, 40)}


def parse_byte_size(size: int | str, *, require_unit: bool = False) -> int:
    """Bytes in `size`: an int, or a number with a unit from the rule above (module docstring).

    `require_unit`: refuse a bare number (where "80" is far likelier a forgotten GiB than 80 bytes).
    Raises ValueError saying what was read and how to write it: "'TEXT': the reason; the fix".
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value, unit = float(size), ""
    else:
        match = _SIZE.fullmatch(str(size).lower())
        if not match:
            raise ValueError(f"{size!r}: not a size; write bytes or a number with a unit, e.g. 80GiB, 5GB or 500MB")
        value, unit = float(match.group(1)), match.group(2)
        if unit in _BARE_LETTERS:
            number, letter = match.group(1), unit.upper()
            decimal, binary = _BARE_LETTERS[unit]
            raise ValueError(f"{size!r}: {letter} alone is ambiguous; write {number}{letter}B "
                             f"(10^{decimal} bytes each) or {number}{letter}iB (2^{binary} bytes each)")
        if unit not in UNITS:
            raise ValueError(f"{size!r}: unknown unit {match.group(2)!r}; use B, KB, MB, GB, TB (powers of 10) "
                             "or KiB, MiB, GiB, TiB (powers of 2)")
        if require_unit and not unit:
            raise ValueError(f"{size!r}: no unit; write {match.group(1)}GiB (or GB for 10^9 bytes, B for bytes)")
    if value <= 0:
        raise ValueError(f"{size!r}: a size must be more than 0 bytes")
    return int(value * UNITS[unit])


def format_bytes(n: int) -> str:
    """Bytes in MiB below 1 GiB, then GiB: two decimals below 10 GiB, one above (binary units, as
    devices and allocators report memory; parse_byte_size reads the text back)."""
    gib = n / _GIB
    if gib < 1:
        return f"{n / 2**20:.1f} MiB"
    return f"{gib:.2f} GiB" if gib < 10 else f"{gib:.1f} GiB"
