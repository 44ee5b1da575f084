"""``measured`` in a router config file is a list of bench JSON files: a bare string (which TOML
allows) was iterated one character at a time, each character joined to the config's directory
and read as a measurement file."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig


@pytest.mark.parametrize("value", ['"host.json"', "7", '["host.json", 7]'])
def test_measured_that_is_not_a_list_of_files_is_refused_by_name(tmp_path, value):
    path = tmp_path / "router.toml"
    path.write_text(f'measured = {value}\n[[worker]]\nurl = "http://127.0.0.1:9"\n')
    with pytest.raises(ConfigError, match=r"measured must be a list of bench JSON files, e\.g\. measured = "
                                          r"\[\"host\.json\"\]"):
        RouterConfig.from_file(path)


def test_a_list_of_files_is_found_beside_the_config(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('measured = ["host.json"]\n[[worker]]\nurl = "http://127.0.0.1:9"\n')
    assert RouterConfig.from_file(path).measured == [str(tmp_path / "host.json")]
