"""Defaults that do not surprise: cleartext TCP only on loopback unless asked for, a loud word about
unencrypted spill, names matched whole (no trailing newline)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.server.auth import AuthError, Authenticator, hash_token
from kvtier.server.config import ServerConfig, TenantConfig, check_namespace, load_config
from kvtier.server.launch import ServerProcess, _read_line

HASH = hash_token("acme-token")


@pytest.mark.parametrize("url", ["tcp://0.0.0.0:7070", "tcp://192.168.1.20:7070", "tcp://[::]:7070",
                                 "tcp://kv-0.example.com:7070"])
def test_cleartext_tcp_beyond_loopback_is_refused_and_the_error_names_the_fixes(url):
    with pytest.raises(ConfigError) as refused:
        load_config(None, env={}, overrides={"listen": url})
    message = str(refused.value)
    assert "tls://" in message and "tls_cert" in message and "unix://" in message
    assert "--insecure-plaintext" in message and "insecure_plaintext = true" in message
    # asked for explicitly: by flag, config file key or environment
    assert load_config(None, env={}, overrides={"listen": url, "insecure_plaintext": True}).insecure_plaintext
    assert load_config(None, env={"KVTIER_SERVE_INSECURE_PLAINTEXT": "1"}, overrides={"listen": url}).listen == (url,)


def test_loopback_tls_and_unix_listeners_need_no_flag(tmp_path):
    for url in ["tcp://127.0.0.1:0", "tcp://127.8.9.10:7070", "tcp://[::1]:7070", "tcp://localhost:7070",
                "unix:///run/kvtier/kvtier.sock"]:
        assert load_config(None, env={}, overrides={"listen": url}).listen == (url,)
    c = load_config(None, env={}, overrides={"listen": "tls://0.0.0.0:7443", "tls_cert": "c.pem", "tls_key": "k.pem"})
    assert not c.insecure_plaintext
    path = tmp_path / "c.toml"
    path.write_text('[server]\nlisten = ["tcp://0.0.0.0:7070"]\ninsecure_plaintext = true\n')
    assert load_config(path, env={}).insecure_plaintext


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.server", "--tenant", f"acme={HASH}", *args]


def test_serve_refuses_a_cleartext_lan_listener_and_says_how_to_fix_it():
    out = subprocess.run(_serve("--listen", "tcp://0.0.0.0:0"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "tls://0.0.0.0:0" in out.stderr and "--insecure-plaintext" in out.stderr


def test_serve_start_line_warns_of_cleartext_and_of_an_unencrypted_disk_dir(tmp_path):
    """With --insecure-plaintext it serves, and says so; a plaintext disk_dir is named on stderr, once."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _serve("--listen", "tcp://0.0.0.0:0", "--insecure-plaintext", "--disk-dir", str(tmp_path / "disk"),
                   "--disk-capacity", "64MiB"),
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "KVTIER_MASTER_KEY"})
    try:
        assert '"ready": true' in _read_line(proc, 30), log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        proc.stdout.close()
    err = log_path.read_text()
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert any("cleartext on tcp://0.0.0.0:0" in line for line in warnings), err
    assert sum("UNENCRYPTED" in line for line in err.splitlines()) == 1, err  # the log does not repeat it
    assert any(str(tmp_path / "disk") in line and "encrypt_at_rest" in line for line in warnings), err


def test_a_sealed_disk_dir_gets_no_warning(tmp_path):
    with ServerProcess.start({"acme": "acme-token"}, workdir=str(tmp_path), env={"KVTIER_MASTER_KEY": "5a" * 32}, server={
        "disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB", "encrypt_at_rest": True,
    }) as srv:
        pass
    assert "UNENCRYPTED" not in srv.log() and "WARNING" not in srv.log()


@pytest.mark.parametrize("name", ["acme\n", "acme\r\n", " acme", "acme/x", ""])
def test_names_are_matched_whole(name):
    """``re.match`` with ``$`` accepts "acme\\n": a name must match from its first to its last character."""
    with pytest.raises(ConfigError, match="letters, digits"):
        ServerConfig(tenants=(TenantConfig(name, (HASH,)),))
    with pytest.raises(ConfigError):
        check_namespace(name)
    with pytest.raises(ConfigError):
        check_namespace("shared/" + name)
    auth = Authenticator(ServerConfig(tenants=(TenantConfig("acme", (HASH,)),)))
    with pytest.raises(AuthError):
        auth.authenticate("acme-token", name)
    assert auth.authenticate("acme-token", "ns").tenant == "acme"


def test_token_digests_are_matched_whole():
    with pytest.raises(ConfigError, match="SHA-256"):
        ServerConfig(tenants=(TenantConfig("acme", (HASH + "\n",)),))


def test_the_key_space_cache_is_bounded_whatever_namespaces_hellos_name(monkeypatch):
    import kvtier.server.auth as auth_module

    monkeypatch.setattr(auth_module, "SPACE_CACHE_SIZE", 100, raising=False)
    auth = Authenticator(ServerConfig(tenants=(TenantConfig("acme", (HASH,)),)))
    first = auth.authenticate("acme-token", "ns0").write_space
    for i in range(1, 1000):
        auth.authenticate("acme-token", f"ns{i}")
    assert len(auth._spaces) <= 100
    # an evicted space is made again, the same: its storage keys do not change
    again = auth.authenticate("acme-token", "ns0").write_space
    assert again.storage_key(b"k" * 32) == first.storage_key(b"k" * 32)
    hot = auth.space("acme", "hot")
    for i in range(150):          # a space in use stays cached (least recently used goes first)
        auth.space("acme", f"cold{i}")
        assert auth.space("acme", "hot") is hot
