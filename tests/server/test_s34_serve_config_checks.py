"""`kvtier serve` start-up settings and the remote client's namespace, each found failing so (audit
s34/a11): an IPv6 ready line no client could parse, two [[shared]] tables of one name mixed, a NUL
in a path crashing start-up with a traceback, a misspelt KVTIER_SERVE_* variable dropped without a
word, and a namespace every server refuses accepted by the client's config."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvtier.core.keys import BlockKey
from kvtier.errors import ConfigError
from kvtier.server.auth import hash_token
from kvtier.server.config import load_config, parse_listen
from kvtier.server.launch import ServerProcess, write_config
from kvtier.store.config import StoreConfig
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier

TOKEN = "s34-serve-token-aaaa"
TENANTS = {"acme": {"token": TOKEN}}


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _serve(config_path: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`kvtier serve --config PATH` expected to refuse its settings (it exits before listening; one
    that starts instead is stopped by the timeout)."""
    return subprocess.run([sys.executable, "-m", "kvtier.server", "--config", config_path], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def _config(tmp_path, server: dict | None = None, shared: list[dict] | None = None) -> str:
    path = str(tmp_path / "kvtier.toml")
    write_config(path, {"listen": [f"unix://{tmp_path}/kv.sock"], **(server or {})}, TENANTS, shared)
    return path


def _refused_in_one_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtier serve: "), result.stderr
    for word in words:
        assert word in lines[0]


# D1: the ready line's addresses are what clients are handed


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_listener_reports_addresses_a_client_can_use():
    with ServerProcess.start(TENANTS, tcp=False, server={"listen": ["tcp://[::1]:0"], "metrics": "[::1]:0"}) as srv:
        assert srv.url.startswith("tcp://[::1]:"), srv.url
        tier = RemoteTier(srv.url, TOKEN, namespace="ipv6", timeout_s=5)
        try:
            key = BlockKey(os.urandom(32))
            assert tier.put(key, b"x" * 4096) == Status.OK
            assert tier.ping()
        finally:
            tier.close()
        metrics = srv.info["metrics"]
        assert metrics.startswith("[::1]:"), metrics
        _, host, port = parse_listen("tcp://" + metrics)
        with socket.create_connection((host, port), timeout=5):
            pass


# D2: a repeated [[shared]] name, refused like a repeated [[tenant]]


def test_two_shared_tables_of_one_name_are_refused(tmp_path):
    path = _config(tmp_path, shared=[{"name": "prompts", "writers": ["acme"], "ttl_s": 600},
                                     {"name": "prompts", "writers": []}])
    with pytest.raises(ConfigError, match="shared namespace 'prompts' is defined twice"):
        load_config(path, env={})


# D3: a NUL in a setting, refused by the config checks with the setting's name


@pytest.mark.parametrize("key, value", [
    ("listen", ["unix:///tmp/kv\x00s.sock"]),   # a list of strings
    ("audit_log", "/tmp/a\x00b"),                # an optional string
    ("state_dir", "/tmp/a\x00b"),
    ("mooncake_hostname", "10.0.0.7\x00"),       # a required string
])
def test_a_nul_in_a_setting_is_refused_naming_it(tmp_path, key, value):
    path = _config(tmp_path, server={key: value})
    with pytest.raises(ConfigError, match=rf"\[server\] {key} = .*NUL"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=f"KVTIER_SERVE_{key.upper()} = .*NUL"):
        load_config(None, env={f"KVTIER_SERVE_{key.upper()}": ",".join(value) if isinstance(value, list) else value})


def test_parse_listen_refuses_a_nul():
    with pytest.raises(ConfigError, match="NUL"):
        parse_listen("unix:///tmp/kv\x00s.sock")


def test_serve_refuses_a_nul_path_in_one_line(tmp_path):
    path = _config(tmp_path, server={"audit_log": "/tmp/a\x00b"})
    _refused_in_one_line(_serve(path), "audit_log", "NUL")


# D4: KVTIER_SERVE_* variables, checked like the file's [server] keys


def test_a_misspelt_serve_variable_is_refused_with_the_likely_name():
    with pytest.raises(ConfigError, match="'KVTIER_SERVE_MAX_CONECTIONS'; did you mean 'KVTIER_SERVE_MAX_CONNECTIONS'"):
        load_config(None, env={"KVTIER_SERVE_MAX_CONECTIONS": "4"})
    with pytest.raises(ConfigError, match="did you mean 'KVTIER_SERVE_ENCRYPT_AT_REST'"):
        load_config(None, env={"KVTIER_SERVE_ENCRYPT_AT_RST": "true"})


def test_every_serve_variable_in_use_is_still_read():
    env = {"KVTIER_SERVE_TENANTS": f"acme={hash_token(TOKEN)}", "KVTIER_SERVE_MAX_CONNECTIONS": "4",
           "KVTIER_SERVE_CAPACITY": "128MiB", "KVTIER_SERVE_IDLE_TIMEOUT_S": "20",
           "KVTIER_SERVE_MAX_UNAUTHENTICATED": "3", "KVTIER_SERVE_MAX_CONNECTIONS_PER_TENANT": "2",
           "KVTIER_SERVE_FLEET_AUDIT_INTERVAL_S": "2.5", "KVTIER_SERVE_INSECURE_PLAINTEXT": "0",
           "KVTIER_SERVE_ADMIN_TOKEN_SHA256": hash_token("admin"),
           "KVTIER_TOKEN": "a client's variable, not the server's"}
    c = load_config(None, env=env)
    assert [t.name for t in c.tenants] == ["acme"]
    assert (c.max_connections, c.capacity_bytes, c.idle_timeout_s) == (4, 128 << 20, 20)
    assert (c.max_unauthenticated, c.max_connections_per_tenant, c.fleet_audit_interval_s) == (3, 2, 2.5)


def test_serve_refuses_a_misspelt_variable_in_one_line(tmp_path):
    result = _serve(_config(tmp_path), env={"KVTIER_SERVE_MAX_CONECTIONS": "4"})
    _refused_in_one_line(result, "KVTIER_SERVE_MAX_CONECTIONS", "did you mean 'KVTIER_SERVE_MAX_CONNECTIONS'")


# D5: a namespace no server accepts, refused where the client is configured


@pytest.mark.parametrize("namespace", ["llama 70b", "a/b", "shared/", "-lead", "x" * 65, "shared/a b"])
def test_a_namespace_no_server_accepts_is_refused_by_the_client_config(namespace):
    url = "tcp://127.0.0.1:7070"
    with pytest.raises(ConfigError, match="remote_namespace: namespace"):
        StoreConfig(host_bytes=0, remote_url=url, remote_token=TOKEN, remote_namespace=namespace)
    with pytest.raises(ConfigError, match=r"\?namespace=: namespace"):
        StoreConfig(host_bytes=0, remote_url=f"{url}?namespace={namespace}", remote_token=TOKEN)
    with pytest.raises(ConfigError, match="namespace"):
        RemoteTier(url, TOKEN, namespace=namespace)


def test_the_names_a_server_accepts_pass_the_client_and_work():
    for namespace in ("llama-70b", "shared/system-prompts", "v1.2_base"):
        StoreConfig(host_bytes=0, remote_url="tcp://127.0.0.1:7070", remote_token=TOKEN, remote_namespace=namespace)
    with ServerProcess.start(TENANTS) as srv:
        tier = RemoteTier(srv.url, TOKEN, namespace="llama-70b.v1_2", timeout_s=5)
        try:
            key = BlockKey(os.urandom(32))
            assert tier.put(key, b"y" * 4096) == Status.OK
            assert tier.contains(key)
        finally:
            tier.close()
