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
