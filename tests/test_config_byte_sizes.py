"""The one size rule (zerotrain/config/byte_sizes.py): GB = 10^9, GiB = 2^30, for every command that
takes a size, so `plan`'s "80GB" and `consolidate`'s "80GB" are the same number of bytes."""

from __future__ import annotations

import re

import pytest

GIB = 2**30


@pytest.mark.parametrize(("text", "expected"), [
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("80 GB", 80 * 10**9), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6),
    ("10kB", 10_000), ("2TB", 2 * 10**12),
    ("80GiB", 80 * GIB), ("80 gib", 80 * GIB), ("512MiB", 512 * 2**20), ("4KiB", 4096), ("1.5TiB", int(1.5 * 2**40)),
    ("123", 123), ("123B", 123), (123, 123),
])
def test_si_units_are_decimal_and_binary_units_are_written_out(text, expected):
    from zerotrain.config.byte_sizes import parse_byte_size

    assert parse_byte_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("80G", "'80G': G alone is ambiguous; write 80GB (10^9 bytes each) or 80GiB (2^30 bytes each)"),
    ("eighty", "'eighty': not a size; write bytes or a number with a unit, e.g. 80GiB"),
    ("5 parsecs", "unknown unit 'parsecs'"),
    ("0GB", "more than 0 bytes"),
])
def test_a_size_that_cannot_be_read_says_how_to_write_it(text, message):
    from zerotrain.config.byte_sizes import parse_byte_size

    with pytest.raises(ValueError, match=re.escape(message)):
        parse_byte_size(text)


def test_a_required_unit_refuses_a_bare_number():
    from zerotrain.config.byte_sizes import parse_byte_size

    with pytest.raises(ValueError, match="'80': no unit; write 80GiB"):
        parse_byte_size("80", require_unit=True)
    assert parse_byte_size("80GiB", require_unit=True) == 80 * GIB


def test_the_formatter_writes_binary_units_the_parser_reads_back():
    from zerotrain.config.byte_sizes import format_bytes, parse_byte_size

    for n in (5 * 2**20, 3 * GIB, 80 * GIB):
        text = format_bytes(n).replace(" ", "")
        assert parse_byte_size(text) == n, text
    assert format_bytes(80 * 10**9) == "74.5 GiB"  # "80GB" is not an 80 GiB GPU


def test_plan_estimate_init_tune_and_consolidate_read_a_size_alike():
    """`plan --gpu-memory 80GB` used to be 80 x 2^30 bytes while `consolidate --max-shard-size 80GB` was 80 x 10^9."""
    from zerotrain.cli.main import build_parser
    from zerotrain.planning.wizard_questions import GPU_MEMORY

    parser = build_parser()
    for text, expected in (("80GB", 80 * 10**9), ("80GiB", 80 * GIB), ("1.5TB", 1_500_000_000_000)):
        shard = parser.parse_args(["consolidate", "ckpt", "out", "--max-shard-size", text]).max_shard_size
        plan = parser.parse_args(["plan", "llama", "--gpu-memory", text, "--cpu-memory", text]).gpu_memory
        estimate = parser.parse_args(["estimate", "llama", "--gpu-memory", text]).gpu_memory
        init = GPU_MEMORY.parse(parser.parse_args(["init", "llama", "--gpu-memory", text]).gpu_memory)  # an answer
        tune = parser.parse_args(["tune", "run.yaml", "--gpu-memory", text]).gpu_memory
        assert (shard, plan, estimate, init, tune) == (expected,) * 5, text
