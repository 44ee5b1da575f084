"""Secrets read only from a private regular file, and directories made 0700 without following a
link (audit s26: D4, a FIFO given as a secret hung startup in open(); and the optional items: a
secret's size cap, the chmod of a new directory through a link planted in its place)."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from kvtier import private_files
from kvtier.errors import ConfigError
from kvtier.private_files import make_private_dirs, open_private_file, read_private_file


def _within(seconds: float, fn):
    """``fn()``'s result or exception, or AssertionError if it is still running after ``seconds``."""
    result: dict = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            result["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return t.is_alive(), result


@pytest.mark.parametrize("reader", [
    lambda p: read_private_file(p, "mooncake_secret_file", "fix it"),
    lambda p: os.close(open_private_file(p, "tls_key", "fix it")),
], ids=["read_private_file", "open_private_file"])
def test_a_secret_that_is_a_fifo_is_refused_not_waited_on(tmp_path, reader):
    fifo = str(tmp_path / "secret")
    os.mkfifo(fifo, 0o600)
    hung, result = _within(3, lambda: reader(fifo))
    if hung:  # let the blocked open() return so that the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not hung, "blocked in open() on a FIFO instead of refusing it"
    assert isinstance(result.get("error"), ConfigError) and "regular file" in str(result["error"])


def test_control_a_private_regular_file_is_read_and_its_descriptor_blocks(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"s" * 32)
    path.chmod(0o600)
    assert read_private_file(str(path), "spill secret", "fix it") == b"s" * 32
    fd = open_private_file(str(path), "tls_key", "fix it")
    try:
        assert os.get_blocking(fd)   # O_NONBLOCK was for the open only
    finally:
        os.close(fd)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_private_file(str(path), "spill secret", "fix it")


def test_a_secret_larger_than_the_cap_is_refused_before_it_is_read_whole(tmp_path):
    from kvtier.private_files import MAX_SECRET_BYTES

    path = tmp_path / "secret"
    path.write_bytes(b"s" * MAX_SECRET_BYTES)
    path.chmod(0o600)
    assert len(read_private_file(str(path), "spill secret", "fix it")) == MAX_SECRET_BYTES   # control
    with open(path, "ab") as f:
        f.write(b"s")
    with pytest.raises(ConfigError, match=f"spill secret .* is larger than {MAX_SECRET_BYTES} bytes"):
        read_private_file(str(path), "spill secret", "fix it")


def test_a_new_directory_swapped_for_a_link_before_its_chmod_does_not_open_up_the_target(tmp_path, monkeypatch):
    """In a parent others may write to, the directory just made is renamed away and a link to a
    directory of the victim's put in its place, between mkdir and chmod."""
    victim = tmp_path / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    real_mkdir = os.mkdir

    def mkdir_then_swap(path, mode=0o777, **kw):
        real_mkdir(path, mode, **kw)
        os.rename(path, f"{path}.moved")
        os.symlink(victim, path)

    monkeypatch.setattr(private_files.os, "mkdir", mkdir_then_swap)
    with pytest.raises(OSError):
        make_private_dirs(tmp_path / "made")
    monkeypatch.undo()
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755


def test_control_new_directories_are_0700_under_any_umask(tmp_path):
    old = os.umask(0o477)   # mkdir gives 0300: the owner may not even read it
    try:
        make_private_dirs(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "a", tmp_path / "a" / "b")] == [0o700, 0o700]


def test_a_directory_the_owner_cannot_read_is_still_made_0700(tmp_path, monkeypatch):
    """Root reads any directory: the refused open of an unreadable one (any other user) is simulated."""
    real_open = os.open

    def unreadable(path, flags, *a, **k):
        if flags & os.O_DIRECTORY and not flags & os.O_PATH:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a, **k)

    old = os.umask(0o022)
    monkeypatch.setattr(private_files.os, "open", unreadable)
    try:
        make_private_dirs(tmp_path / "a")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700
