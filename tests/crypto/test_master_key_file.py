"""``FileMasterKey``: what a master key file may be, and how it is read.

32 bytes of text (a 16-byte key in hex, a passphrase) are not the raw key: refused as they are with
a newline or in ``$KVTIER_MASTER_KEY``. A FIFO is refused, never waited on; a directory, a file too
large or one this process may not read is a ``ConfigError`` naming it, never a traceback. Links are
followed: Kubernetes mounts secrets as links. (From audit s27 crypto2, P1 and P2.)
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap

import pytest

from kvtier.crypto.providers import MAX_KEY_FILE_BYTES, EnvMasterKey, FileMasterKey
from kvtier.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = bytes(range(200, 232))  # not all text: a raw key


def _key_file(path, data: bytes, mode: int = 0o600):
    path.write_bytes(data)
    path.chmod(mode)
    return path


# -- P1: 32 characters of text are no raw key ---------------------------------------------------
@pytest.mark.parametrize("text", [
    os.urandom(16).hex(),                         # a 16-byte key as hex (printf '%s' "$(openssl rand -hex 16)")
    "correct-horse-battery-staple-123",           # a passphrase that happens to be 32 characters
    "correct horse battery staple 12\n",          # 31 characters and a newline: text, 32 bytes
], ids=["hex_of_16_bytes", "passphrase", "31_characters_and_a_newline"])
def test_a_key_file_of_32_characters_of_text_is_refused_like_the_same_text_with_a_newline(tmp_path, monkeypatch,
                                                                                         text):
    assert len(text) == 32
    with_newline = _key_file(tmp_path / "nl.key", text.encode() + b"\n")
    with pytest.raises(ConfigError, match="32-byte key"):
        FileMasterKey(with_newline).master_key()  # control: refused
    monkeypatch.setenv("KVTIER_TEST_KEY", text)
    with pytest.raises(ConfigError, match="32-byte key"):
        EnvMasterKey("KVTIER_TEST_KEY").master_key()  # control: the env provider refuses the same text
    bare = _key_file(tmp_path / "bare.key", text.encode())  # no trailing newline (editors, printf, echo -n)
    with pytest.raises(ConfigError, match="32-byte key"):
        key = FileMasterKey(bare).master_key()
        pytest.fail(f"32 characters of text taken as the raw master key {key!r}")


def test_a_raw_binary_key_file_still_works(tmp_path):
    assert FileMasterKey(_key_file(tmp_path / "raw.key", KEY)).master_key() == KEY
    # a raw key with a byte of text's whitespace in it is still raw: one byte outside text suffices
    raw = b"\n" + bytes(range(0x80, 0x9F))
    assert FileMasterKey(_key_file(tmp_path / "raw2.key", raw)).master_key() == raw


@pytest.mark.parametrize("text", [KEY.hex(), KEY.hex() + "\n", KEY.hex().upper() + "\r\n",
                                  base64.b64encode(KEY).decode(), base64.b64encode(KEY).decode() + "\n",
                                  "  " + KEY.hex() + "  \n"],
                         ids=["hex", "hex_newline", "hex_upper_crlf", "base64", "base64_newline", "hex_spaces"])
def test_a_key_written_as_hex_or_base64_still_works(tmp_path, text):
    assert FileMasterKey(_key_file(tmp_path / "text.key", text.encode())).master_key() == KEY


def test_the_env_provider_is_unchanged(monkeypatch):
    monkeypatch.setenv("KVTIER_TEST_KEY", KEY.hex() + "\n")
    assert EnvMasterKey("KVTIER_TEST_KEY").master_key() == KEY
    monkeypatch.setenv("KVTIER_TEST_KEY", base64.b64encode(KEY).decode())
    assert EnvMasterKey("KVTIER_TEST_KEY").master_key() == KEY
    monkeypatch.setenv("KVTIER_TEST_KEY", KEY.hex()[:32])
    with pytest.raises(ConfigError, match="32-byte key"):
        EnvMasterKey("KVTIER_TEST_KEY").master_key()


# -- P2: what the path names --------------------------------------------------------------------
def test_a_symlinked_key_file_works(tmp_path):
    # as Kubernetes mounts a secret: <dir>/master.key -> ..data/master.key, ..data -> ..<timestamp>
    stamped = tmp_path / "..2024_01_01"
    stamped.mkdir()
    _key_file(stamped / "master.key", KEY.hex().encode() + b"\n")
    (tmp_path / "..data").symlink_to(stamped.name)
    link = tmp_path / "master.key"
    link.symlink_to("..data/master.key")
    assert FileMasterKey(link).master_key() == KEY


def test_a_link_to_a_file_others_may_read_is_refused(tmp_path):
    target = _key_file(tmp_path / "open.key", KEY.hex().encode(), mode=0o644)
    link = tmp_path / "master.key"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="chmod 600"):
        FileMasterKey(link).master_key()  # the file it leads to is the one judged


def _provider_in_child(path: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import signal
        signal.alarm(5)  # the start must not wait for a writer that never comes
        from kvtier.crypto.providers import FileMasterKey
        from kvtier.errors import ConfigError
        try:
            FileMasterKey({path!r}).master_key()
        except ConfigError as exc:
            print("CONFIG_ERROR", exc)
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_a_master_key_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "master.key"
    os.mkfifo(fifo, 0o600)
    done = _provider_in_child(str(fifo))
    assert done.returncode == 0 and "CONFIG_ERROR" in done.stdout, (
        f"rc={done.returncode} (-14: still blocked in open() after 5 s): {done.stdout}{done.stderr[-300:]}")
    assert str(fifo) in done.stdout and "not a regular file" in done.stdout


def test_a_link_to_a_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "pipe", 0o600)
    (tmp_path / "master.key").symlink_to("pipe")
    done = _provider_in_child(str(tmp_path / "master.key"))
    assert done.returncode == 0 and "not a regular file" in done.stdout, f"{done.stdout}{done.stderr[-300:]}"


def test_a_master_key_file_that_is_a_directory_is_a_config_error(tmp_path):
    directory = tmp_path / "secret"
    directory.mkdir(mode=0o700)
    done = _provider_in_child(str(directory))
    assert "CONFIG_ERROR" in done.stdout, f"not a ConfigError (a traceback at start): {done.stderr[-300:]}"
    assert str(directory) in done.stdout


def test_a_missing_key_file_or_a_dangling_link_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        FileMasterKey(tmp_path / "none.key").master_key()
    (tmp_path / "dangling.key").symlink_to("none.key")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'dangling.key'} does not exist"):
        FileMasterKey(tmp_path / "dangling.key").master_key()


def test_a_path_through_a_file_is_a_config_error(tmp_path):
    _key_file(tmp_path / "file", KEY)
    with pytest.raises(ConfigError, match="cannot read master key file .*Not a directory"):
        FileMasterKey(tmp_path / "file" / "master.key").master_key()


def test_a_key_file_this_process_may_not_read_is_a_config_error(tmp_path):
    # a root-owned 0600 secret and a server that is not root: as root, the child becomes nobody
    path = _key_file(tmp_path / "master.key", KEY, mode=0o600 if os.geteuid() == 0 else 0o000)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                FileMasterKey(path).master_key()
                said = "READ"
            except ConfigError as exc:
                said = f"CONFIG_ERROR {exc}"
            except BaseException as exc:
                said = f"{type(exc).__name__} {exc}"
            os.write(write_end, said.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    assert said.startswith("CONFIG_ERROR cannot read master key file") and "Permission denied" in said, said


def test_a_key_file_larger_than_a_key_file_is_refused_before_it_is_read_whole(tmp_path):
    path = _key_file(tmp_path / "master.key", KEY.hex().encode() + b" " * MAX_KEY_FILE_BYTES)
    with pytest.raises(ConfigError, match=f"larger than {MAX_KEY_FILE_BYTES} bytes"):
        FileMasterKey(path).master_key()
    padded = _key_file(tmp_path / "padded.key", KEY.hex().encode().ljust(MAX_KEY_FILE_BYTES))
    assert FileMasterKey(padded).master_key() == KEY  # at the bound: read
