"""The connector's safe defaults, without an engine: vLLM's non-cryptographic block hashes are refused
as key material (or, when explicitly allowed, warned about), and the scheduler's lookup socket lives in
a private directory, checks its peer and survives whatever squats its path."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig, check_block_hashes
from kvtier.integrations.vllm.lookup_service import (
    LookupClient,
    LookupServer,
    lookup_dir,
    peer_allowed,
    socket_path,
)
from kvtier.store import safety


# -- block hashes ------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_non_cryptographic_block_hashes_are_refused_with_the_fix(algo):
    with pytest.raises(ConfigError) as refused:
        check_block_hashes(ConnectorConfig(), SimpleNamespace(prefix_caching_hash_algo=algo))
    message = str(refused.value)
    assert algo in message and "sha256" in message and "allow_weak_block_hashes" in message


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_weak_block_hashes_explicitly_allowed_are_warned_about_once(algo, caplog, monkeypatch):
    monkeypatch.setattr(safety, "_said", set())
    config = ConnectorConfig.from_extra_config({"allow_weak_block_hashes": True})
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for _ in range(2):
            check_block_hashes(config, SimpleNamespace(prefix_caching_hash_algo=algo))
    said = [r.getMessage() for r in caplog.records if "non-cryptographic" in r.getMessage()]
    assert len(said) == 1 and algo in said[0]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_block_hashes_pass_silently(algo, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        check_block_hashes(ConnectorConfig(), SimpleNamespace(prefix_caching_hash_algo=algo))
    assert not caplog.records


def test_allow_weak_block_hashes_must_be_a_boolean():
    with pytest.raises(ConfigError, match="true or false"):
        ConnectorConfig.from_extra_config({"allow_weak_block_hashes": "yes"})


# -- the lookup socket ---------------------------------------------------------------------
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_socket_lives_in_a_private_directory_not_in_shared_tmp(umask_022):
    short = tempfile.mkdtemp(prefix="k", dir="/tmp")   # pytest's tmp_path is too long for a socket path
    try:
        _socket_in_private_directories(Path(short) / "run")
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _socket_in_private_directories(runtime: Path) -> None:
    runtime.mkdir()
    path = socket_path("engine-1", env={"XDG_RUNTIME_DIR": str(runtime)})
    assert os.path.dirname(path) == str(runtime / "kvtier")
    assert stat.S_IMODE(os.lstat(runtime / "kvtier").st_mode) == 0o700
    # without XDG_RUNTIME_DIR: a per-user 0700 directory under tmp, not a socket straight in /tmp
    path = socket_path("engine-1", env={})
    directory = os.path.dirname(path)
    assert directory == os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}")
    st = os.lstat(directory)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_a_directory_of_ours_with_loose_mode_is_made_private(tmp_path, umask_022):
    (tmp_path / "kvtier").mkdir(mode=0o755)
    assert lookup_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == str(tmp_path / "kvtier")
    assert stat.S_IMODE(os.lstat(tmp_path / "kvtier").st_mode) == 0o700


@pytest.mark.parametrize("squat", ["symlink", "file"])
def test_a_squatted_directory_is_not_used(tmp_path, monkeypatch, squat, caplog):
    """Someone put a symlink (to a directory they control) or a file where our directory goes."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    runtime = tmp_path / "run"
    runtime.mkdir()
    if squat == "symlink":
        (runtime / "kvtier").symlink_to(elsewhere)
    else:
        (runtime / "kvtier").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        chosen = lookup_dir({"XDG_RUNTIME_DIR": str(runtime)})
    assert chosen == str(tmp_path / "tmp" / f"kvtier-{os.getuid()}")  # the next private candidate
    assert "not a directory owned by this user" in caplog.text
    # and with no trustworthy directory at all: no path, a client that misses, a server that does not crash
    (tmp_path / "tmp" / f"kvtier-{os.getuid()}").rmdir()
    (tmp_path / "tmp" / f"kvtier-{os.getuid()}").symlink_to(elsewhere)
    assert socket_path("e", env={"XDG_RUNTIME_DIR": str(runtime)}) is None
    assert not LookupServer(None, lambda keys: 0).serving
    with pytest.raises(OSError):
        LookupClient(None).lookup([b"k" * 32])


def serve(path: str) -> LookupServer:
    return LookupServer(path, lambda keys: len(keys))


def test_lookups_are_answered(tmp_path):
    server = serve(str(tmp_path / "s.sock"))
    try:
        assert server.serving
        assert stat.S_IMODE(os.lstat(tmp_path / "s.sock").st_mode) == 0o600
        client = LookupClient(server.path)
        assert client.lookup([b"a" * 32, b"b" * 32]) == 2
        client.close()
    finally:
        server.close()
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("squat", ["file", "stale socket"])
def test_a_file_or_stale_socket_at_the_path_is_replaced_with_a_log_line(tmp_path, squat, caplog):
    path = tmp_path / "s.sock"
    if squat == "file":
        path.write_text("not a socket")
    else:
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(path))
        dead.close()  # bound, never listening: connections are refused
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        server = serve(str(path))
    try:
        assert server.serving and "replacing the" in caplog.text
        assert LookupClient(str(path)).lookup([b"a" * 32]) == 1
    finally:
        server.close()


def test_a_live_socket_or_a_directory_at_the_path_is_refused_without_crashing(tmp_path, caplog):
    live_path = tmp_path / "live.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(live_path))
    live.listen(1)
    (tmp_path / "dir.sock").mkdir()
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        refused = [serve(str(live_path)), serve(str(tmp_path / "dir.sock"))]
    try:
        assert [s.serving for s in refused] == [False, False]
        assert "already serves lookups" in caplog.text and "a directory sits at" in caplog.text
        assert live_path.exists() and (tmp_path / "dir.sock").is_dir()  # the other's socket is left alone
        for s in refused:
            s.close()
        assert live_path.exists()
    finally:
        live.close()


def test_only_peers_of_this_user_are_served():
    me = os.getuid()
    assert peer_allowed((1234, me, 0), uid=me)
    assert not peer_allowed((1234, me + 1, me), uid=me)
    assert not peer_allowed((1, 0, 0), uid=1000)  # not even root: the worker answers its own user only
    assert not peer_allowed((0, -1, -1), uid=me)  # credentials that could not be read
