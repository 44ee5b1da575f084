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


class FileMasterKey:
    """A key file readable by its owner only (mode 0600 or stricter is enforced)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def master_key(self) -> bytes:
        try:
            mode = self.path.stat().st_mode
        except FileNotFoundError:
            raise ConfigError(f"master key file {self.path} does not exist") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"master key file {self.path} is readable by others; run: chmod 600 {self.path}")
        raw = self.path.read_bytes()
        return raw if len(raw) == 32 else _decode(raw.decode("ascii", "replace"), str(self.path))
