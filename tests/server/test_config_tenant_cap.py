"""``max_connections_per_tenant``: its default (the field's 0) is half of ``max_connections``; a
file, variable or flag gets it by leaving the key out. A written 0 is refused, and the refusal
says so (the field's comment once read as if 0 were a value to write)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.server.config import load_config
from kvtier.server.launch import write_config

LOOPBACK = {"listen": ["tcp://127.0.0.1:0"]}


def test_left_out_it_is_half_of_max_connections(tmp_path):
    path = tmp_path / "c.toml"
    write_config(str(path), {**LOOPBACK, "max_connections": 10}, {"acme": {"token": "t"}})
    assert load_config(path, env={}).tenant_connection_cap == 5


def test_a_written_zero_is_refused_with_the_way_to_the_default(tmp_path):
    path = tmp_path / "c.toml"
    write_config(str(path), {**LOOPBACK, "max_connections_per_tenant": 0}, {"acme": {"token": "t"}})
    for source in (lambda: load_config(path, env={}),
                   lambda: load_config(None, env={"KVTIER_SERVE_MAX_CONNECTIONS_PER_TENANT": "0"}),
                   lambda: load_config(None, env={}, overrides={**LOOPBACK, "max_connections_per_tenant": 0})):
        with pytest.raises(ConfigError, match="(?i)max.connections.per.tenant.*leave it out for the default, half of "
                                              "max_connections"):
            source()
    assert load_config(None, env={}, overrides={**LOOPBACK, "max_connections_per_tenant": 3}) \
        .tenant_connection_cap == 3
