"""Where the master key comes from. A KMS implements :class:`MasterKeyProvider` too.

The master key never encrypts data: it only derives per-tenant key-encryption
keys (see :mod:`kvtier.crypto.keyring`), so it can live in an HSM/KMS that is
asked once per process start.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Protocol

from kvtier.errors import ConfigError


class MasterKeyProvider(Protocol):
    def master_key(self) -> bytes:
        """The 32-byte master key."""
        ...


def _decode(text: str, where: str) -> bytes:
    text = text.strip()
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            raw = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == 32:
            return raw
    raise ConfigError(
        f"{where} must hold a 32-byte key as 64 hex digits or base64; "
        f"make one with: python -c 'import os; print(os.urandom(32).hex())'"
    )


class StaticMasterKey:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ConfigError(f"the master key must be 32 bytes, got {len(key)}")
        self._key = key

    def master_key(self) -> bytes:
        return self._key


class EnvMasterKey:
    def __init__(self, variable: str = "KVTIER_MASTER_KEY") -> None:
        self.variable = variable

    def master_key(self) -> bytes:
        value = os.environ.get(self.variable)
        if not value:
            raise ConfigError(f"set {self.variable} to a 32-byte key (64 hex digits) to enable encryption")
        return _decode(value, f"${self.variable}")


#: the most a master key file may hold: a key is 32 bytes, 64 hex digits or 44 base64 characters
MAX_KEY_FILE_BYTES = 4096
#: bytes of text (printable ASCII and whitespace): a 32-byte file of only these is a key written
#: as text, never the raw key (a random key is all text with probability (100/256)^32, ~1e-13)
_TEXT_BYTES = frozenset(range(0x20, 0x7F)) | frozenset(b"\t\n\v\f\r")


class FileMasterKey:
    """A key file readable by its owner only (mode 0600 or stricter is enforced): the raw 32
    bytes, or the key as 64 hex digits or base64 (whitespace around it ignored). A symbolic
    link is followed (Kubernetes mounts secrets as links); what it leads to must be a regular
    file of at most :data:`MAX_KEY_FILE_BYTES`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def master_key(self) -> bytes:
        raw = self._read()
        if len(raw) == 32 and not _TEXT_BYTES.issuperset(raw):
            return raw
        # 32 characters of text (a 16-byte key in hex, a passphrase) are refused here, as they
        # are with a newline after them or in $KVTIER_MASTER_KEY
        return _decode(raw.decode("ascii", "replace"), str(self.path))

    def _read(self) -> bytes:
        """The file's bytes; every refusal a :class:`ConfigError` naming it (a start must not hang on
        a FIFO, nor end in a traceback on a directory or a file it may not read)."""
        path = self.path
        try:
            # O_NONBLOCK: opening a FIFO for reading would wait for a writer before fstat could
            # refuse it; links followed (no O_NOFOLLOW): the file they lead to is the one judged
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ConfigError(f"master key file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"cannot read master key file {path} ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"master key file {path} is not a regular file; point master_key_file at "
                                  f"the file that holds the key")
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(f"master key file {path} is readable by others; run: chmod 600 {path}")
            chunks, size = [], 0
            # bounded by what is read, not by fstat's size: the file may grow while it is read
            while size <= MAX_KEY_FILE_BYTES and (chunk := os.read(fd, MAX_KEY_FILE_BYTES + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise ConfigError(f"cannot read master key file {path} ({exc.strerror})") from None
        finally:
            os.close(fd)
        if size > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"master key file {path} is larger than {MAX_KEY_FILE_BYTES} bytes: not a key file")
        return b"".join(chunks)
