"""A key store's directory: made private, swept of dead writers' temp files, and tied to one
master key.

``keystore-check.json`` holds an HMAC of a fixed label under the master key, written when the
store is created (for a store from before the check, once a key file there opens under the
master key: :meth:`KeyStoreDir.opened`). Another master key is refused before anything is read
or written: a wrong key would otherwise make new keys beside the old ones and orphan every block.
``required_by`` refuses a missing or empty store the same way, for callers whose data needs the
existing one (the server's spill, an engine's disk tier).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidTag

from kvtier.errors import ConfigError
from kvtier.private_files import fsync_dir, make_private_dirs, replace_private_file

#: the file that ties a key store to its master key
CHECK_FILE = "keystore-check.json"
_CHECK_LABEL = b"kvtier/keystore-check/v1"
#: a tenant's key document (its name: part of an HMAC of the tenant)
_DOC_NAME = re.compile(r"[0-9a-f]{32}\.json")
#: temp files of key-store writes (this version's and older ones'): stem, then what follows
_TEMP_NAME = re.compile(r"([0-9a-f]{32}|keystore-check)\.tmp[0-9]+\.[0-9a-f]+")
#: what a damaged key-store file raises while it is parsed or unwrapped
DAMAGE = (ValueError, KeyError, TypeError, AttributeError, InvalidTag)


def locked(lock_path: Path) -> int:
    """An exclusive ``flock`` on ``lock_path`` (created 0600); close the fd to release it."""
    # O_NOFOLLOW: a link planted as the lock file must not make us create a file elsewhere
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


class KeyStoreDir:
    """Opens ``directory`` as the key store of ``master`` (see the module docstring); raises
    :class:`ConfigError` if it is another master key's, or missing or empty with ``required_by``."""

    def __init__(self, directory: Path, master: bytes, required_by: str | None = None) -> None:
        self.dir = directory
        self._master = master
        self._unverified: set[str] = set()  # key files of a store from before the check
        missing = not self.dir.is_dir()
        if required_by is not None and (missing or not (self.dir / CHECK_FILE).exists() and not self._documents()):
            raise ConfigError(
                f"the key store {self.dir} is {'missing' if missing else 'empty'}, but {required_by}: mount or "
                f"restore it (or fix keystore_dir) and start again. New keys would orphan those blocks, so "
                f"none were made; to start afresh on purpose, delete the blocks first")
        # 0700 whatever the umask, parents included: whoever may write here can shred or replace keys
        make_private_dirs(self.dir)
        self._sweep_temp_files()
        self._check_master()

    def opened(self, name: str) -> None:
        """The key file ``name`` opened under the master key: in a store from before the check,
        that proves the key is this store's, so the check is written now."""
        if name in self._unverified:
            self._write_check()

    def _documents(self) -> list[Path]:
        return [p for p in self.dir.iterdir() if _DOC_NAME.fullmatch(p.name)] if self.dir.is_dir() else []

    def _check_value(self) -> str:
        return hmac.new(self._master, _CHECK_LABEL, hashlib.sha256).hexdigest()

    def _is_mine(self, stored: str) -> bool:
        return hmac.compare_digest(stored.encode(), self._check_value().encode())

    def _stored_check(self) -> str | None:
        try:
            doc = json.loads((self.dir / CHECK_FILE).read_text())
            return str(doc["hmac"])
        except FileNotFoundError:
            return None
        except DAMAGE as exc:
            raise ConfigError(f"{self.dir / CHECK_FILE} is damaged ({exc}); restore it from a backup, or delete "
                              f"it only if you are sure the master key is this key store's") from None

    def _check_master(self) -> None:
        """Refuse another master key's store; write the check if the store has none yet."""
        stored = self._stored_check()
        if stored is None:
            documents = self._documents()
            if documents:
                # A store from before the check: which master key it is can only be told by
                # opening one of its files, so the check is written then (opened), never from a
                # key that might be the wrong one.
                self._unverified = {p.name for p in documents}
            else:
                self._write_check()
        elif not self._is_mine(stored):
            raise self._other_master()

    def _other_master(self) -> ConfigError:
        return ConfigError(
            f"the master key does not match the key store in {self.dir} (see {CHECK_FILE}): start with the "
            f"master key this store was made with (KVTIER_MASTER_KEY or master_key_file), or point "
            f"keystore_dir at this key's own store. New keys here would orphan every block sealed before")

    def _write_check(self) -> None:
        fd = locked(self.dir / "keystore-check.lock")
        try:
            stored = self._stored_check()  # another process may have written it meanwhile
            if stored is None:
                replace_private_file(self.dir / CHECK_FILE, json.dumps({"hmac": self._check_value()}).encode())
                fsync_dir(self.dir)
        finally:
            os.close(fd)
        self._unverified = set()
        if stored is not None and not self._is_mine(stored):
            raise self._other_master()

    def _sweep_temp_files(self) -> None:
        """Remove temp files of writers that died before their rename: each holds a whole key
        document, which a later shred would not remove. A temp file is only ever written under
        its file's lock, so one found while holding that lock has no live writer."""
        for path in self.dir.iterdir():
            match = _TEMP_NAME.fullmatch(path.name)
            if match is None:
                continue
            fd = locked(self.dir / f"{match.group(1)}.lock")
            try:
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
