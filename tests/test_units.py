"""Byte counts for humans: the one formatter and the one parser."""

from __future__ import annotations

import pytest

from hybridllm.errors import ConfigError
from hybridllm.units import format_bytes, parse_bytes


def test_format_bytes_picks_the_largest_unit_that_keeps_the_count_at_least_one():
    assert [format_bytes(n) for n in (None, 0, 512, 1536, 3 * 2**30, 5 * 2**40)] == [
        "-", "0 B", "512 B", "1.5 KiB", "3.0 GiB", "5.0 TiB"]
    assert format_bytes(65536, 0) == "64 KiB" and format_bytes(8 * 2**30, 2) == "8.00 GiB"
    assert format_bytes(4_390_000_000, 2, decimal=True) == "4.39 GB"
    assert format_bytes(999, decimal=True) == "999 B" and format_bytes(1000, decimal=True) == "1.0 kB"


def test_parse_bytes_reads_binary_and_decimal_units():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("2 GB") == 2 * 10**9 and parse_bytes("1.5k") == 1500
    assert parse_bytes(None) is None and parse_bytes(1024) == 1024
    assert parse_bytes(format_bytes(3 * 2**30).replace(" ", "")) == 3 * 2**30  # the formatter's output reads back
    for bad in ("8XB", "GiB", "-1GiB", -1, "nanGB"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
