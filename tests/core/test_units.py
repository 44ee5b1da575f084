"""One size parser for every setting: binary and decimal units exact, ambiguous ones refused."""

import pytest

from kvtier.core.units import parse_size
from kvtier.errors import ConfigError
from kvtier.server import config as server_config
from kvtier.store import config as store_config


@pytest.mark.parametrize("text, nbytes", [
    ("8GiB", 8 << 30), ("32 MiB", 32 << 20), ("1kib", 1024), ("2TiB", 2 << 40),
    ("500 GB", 500 * 10**9), ("1kB", 1000), ("1KB", 1000), ("3mb", 3 * 10**6),
    ("1048576", 1048576), ("1048576B", 1048576), (4096, 4096), (1e9, 10**9),
    ("1.5GiB", 3 << 29), ("0.5KiB", 512), ("1.0001KiB", 1024),  # fractions of a unit round down
])
def test_units_are_exact_powers(text, nbytes):
    assert parse_size(text, "x") == nbytes


@pytest.mark.parametrize("text, fix", [("512M", "512MiB .*512MB"), ("8g", "8GiB .*8GB"), ("4 k", "4KiB .*4KB"),
                                       ("1T", "1TiB .*1TB")])
def test_a_bare_prefix_is_ambiguous_and_the_error_names_both_spellings(text, fix):
    with pytest.raises(ConfigError, match=f"capacity=.*ambiguous.*{fix}"):
        parse_size(text, "capacity")


@pytest.mark.parametrize("bad", ["lots", "", "1.5", "-1", -1, True, "3 PB", 1.5, "1e9", "8 GiB extra"])
def test_bad_sizes_name_the_setting_and_the_fix(bad):
    with pytest.raises(ConfigError, match="quota"):
        parse_size(bad, "quota")


def test_server_store_and_cli_share_the_parser():
    # The bug this replaces: the server read "512M" as 512 MiB, the store refused it.
    assert server_config.parse_size is parse_size
    assert store_config.parse_bytes is parse_size
    for parse in (server_config.parse_size, store_config.parse_bytes):
        with pytest.raises(ConfigError, match="ambiguous"):
            parse("512M", "x")
    with pytest.raises(ConfigError, match="ambiguous"):
        store_config.StoreConfig(host_bytes="1g")


@pytest.mark.parametrize("bad", ["1" * 5000, "1" * 5000 + "GiB", "0." + "1" * 5000 + "GiB"])
def test_a_number_of_thousands_of_digits_is_a_config_error_not_a_value_error(bad):
    """Before: Python's int-max-str-digits ValueError, naming no setting (audit s26, D5)."""
    with pytest.raises(ConfigError, match="capacity=.*too many digits") as info:
        parse_size(bad, "capacity")
    assert len(str(info.value)) < 300   # the number is not repeated whole


@pytest.mark.parametrize("bad", [1 << 63, 10**5000, 1e300, "9223372036854775808", "8388608TiB", "1" * 4000],
                         ids=["2**63", "10**5000", "1e300", "2**63 as text", "8 EiB in TiB", "4000 digits"])
def test_a_size_beyond_8_eib_is_refused(bad):
    with pytest.raises(ConfigError, match="capacity=.*larger than any size"):
        parse_size(bad, "capacity")


def test_control_the_largest_size_is_taken():
    from kvtier.core.units import MAX_SIZE

    assert MAX_SIZE == (1 << 63) - 1
    assert parse_size(MAX_SIZE, "capacity") == parse_size(str(MAX_SIZE), "capacity") == MAX_SIZE
    assert parse_size("8388607TiB", "capacity") == 8388607 << 40
    with pytest.raises(ConfigError, match="capacity=<a number of 16610 bits>: a size cannot be negative"):
        parse_size(-10**5000, "capacity")
