"""Envelope keys: master → per-tenant KEK (HKDF) → per-(tenant, epoch) data keys, stored wrapped.

* A tenant's data keys and its index key (for keyed storage names) are random,
  wrapped with the tenant's KEK (AES-GCM, AAD = tenant and purpose) and kept in
  one JSON file per tenant in ``keystore_dir``. The master key never touches data.
* Rotation: :meth:`Keyring.rotate` starts a new epoch; new writes use it, older
  epochs stay readable until :meth:`Keyring.retire` deletes their wrapped key.
* Crypto-shredding: retiring an epoch or :meth:`Keyring.shred_tenant` deletes
  keys, so every block sealed under them becomes unreadable at once, in every
  tier, files still on disk included.
* Each data key counts its encryptions (chunks) and the keyring rotates at
  :data:`ROTATE_AFTER` = 2^30, well before AES-GCM's random-nonce bound of 2^32.
* Several processes may share a keystore directory: writes are atomic
  (temp + rename) under an ``flock``; a process re-reads a tenant's file when it
  changed, at most every ``refresh_s``, so a shred elsewhere takes effect here
  within ``refresh_s`` (immediately in the shredding process).
* Keys from elsewhere: a read that names an epoch (or key id) this process has
  not loaded -- another process rotated and wrote with the new key -- re-reads
  the tenant's file at once, whatever ``refresh_s`` says, at most once per
  ``missing_reload_s`` per tenant (so a flood of blocks sealed under keys nobody
  here has costs one file read a second, not one per block), and looks again.

Thread safe.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.core.framing import frame_int, frame_str
from kvtier.crypto.providers import MasterKeyProvider

ROTATE_AFTER = 1 << 30
_COUNT_FLUSH = 1 << 16  # persist encryption counts every this many, so a crash loses few


@dataclass(slots=True)
class DataKey:
    tenant: str
    epoch: int
    key_id: bytes
    aead: AESGCM = field(repr=False)
    encryptions: int = 0


@dataclass(slots=True)
class _TenantKeys:
    mtime_ns: int
    checked: float
    current_epoch: int
    keys: dict[int, DataKey]
    index_key: bytes
    created: dict[int, float]
    unflushed: int = 0


class Keyring:
    def __init__(self, provider: MasterKeyProvider, keystore_dir: str | Path, *, refresh_s: float = 1.0,
                 missing_reload_s: float = 1.0) -> None:
        self._master = provider.master_key()
        self.dir = Path(keystore_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.refresh_s = refresh_s
        self.missing_reload_s = missing_reload_s
        self._lock = threading.RLock()
        self._tenants: dict[str, _TenantKeys] = {}
        self._missing_reloads: dict[str, float] = {}  # tenant -> when a missing key last forced a re-read
        self.missing_key_reloads = 0  #: re-reads forced by a missing key (observability, tests)

    # -- derivations ------------------------------------------------------------
    def _kek(self, tenant: str) -> AESGCM:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvtier/kek/v1", info=frame_str(1, tenant))
        return AESGCM(hkdf.derive(self._master))

    def _file(self, tenant: str) -> Path:
        # The file name must not reveal the tenant either.
        name = hmac.new(self._master, frame_str(2, tenant), hashlib.sha256).hexdigest()[:32]
        return self.dir / f"{name}.json"

    @staticmethod
    def _key_id(tenant: str, epoch: int, raw: bytes) -> bytes:
        return hashlib.sha256(frame_str(1, tenant) + frame_int(2, epoch) + raw).digest()[:16]

    def _wrap(self, tenant: str, purpose: str, raw: bytes) -> str:
        nonce = os.urandom(12)
        sealed = self._kek(tenant).encrypt(nonce, raw, frame_str(1, tenant) + frame_str(2, purpose))
        return base64.b64encode(nonce + sealed).decode()

    def _unwrap(self, tenant: str, purpose: str, text: str) -> bytes:
        blob = base64.b64decode(text)
        return self._kek(tenant).decrypt(blob[:12], blob[12:], frame_str(1, tenant) + frame_str(2, purpose))

    # -- persistence ------------------------------------------------------------
    def _locked_file(self, tenant: str):
        lock_path = self._file(tenant).with_suffix(".lock")
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _read_doc(self, tenant: str) -> dict | None:
        try:
            return json.loads(self._file(tenant).read_text())
        except FileNotFoundError:
            return None

    def _write_doc(self, tenant: str, doc: dict) -> None:
        path = self._file(tenant)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)

    def _load(self, tenant: str, *, create: bool) -> _TenantKeys | None:
        """The tenant's keys, re-read if the file changed; created if absent and ``create``."""
        now = time.monotonic()
        cached = self._tenants.get(tenant)
        if cached is not None and now - cached.checked < self.refresh_s:
            return cached
        path = self._file(tenant)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if cached is not None and mtime == cached.mtime_ns:
            cached.checked = now
            return cached
        if mtime is None:
            self._tenants.pop(tenant, None)
            if not create:
                return None
            fd = self._locked_file(tenant)
            try:
                if self._read_doc(tenant) is None:
                    raw = AESGCM.generate_key(256)
                    doc = {
                        "version": 1,
                        "current_epoch": 0,
                        "index_key": self._wrap(tenant, "index", os.urandom(32)),
                        "epochs": {"0": {"key": self._wrap(tenant, "data/0", raw), "created": time.time(), "encryptions": 0}},
                    }
                    self._write_doc(tenant, doc)
            finally:
                os.close(fd)
            return self._load(tenant, create=False)
        doc = self._read_doc(tenant)
        if doc is None:
            return self._load(tenant, create=create)
        keys = {}
        created = {}
        for text_epoch, entry in doc["epochs"].items():
            epoch = int(text_epoch)
            raw = self._unwrap(tenant, f"data/{epoch}", entry["key"])
            keys[epoch] = DataKey(tenant, epoch, self._key_id(tenant, epoch, raw), AESGCM(raw), entry["encryptions"])
            created[epoch] = entry["created"]
        state = _TenantKeys(
            mtime_ns=path.stat().st_mtime_ns,
            checked=now,
            current_epoch=doc["current_epoch"],
            keys=keys,
            index_key=self._unwrap(tenant, "index", doc["index_key"]),
            created=created,
        )
        self._tenants[tenant] = state
        return state

    # -- public API -----------------------------------------------------------------
    def key_for_write(self, tenant: str) -> DataKey:
        with self._lock:
            state = self._load(tenant, create=True)
            key = state.keys.get(state.current_epoch)
            if key is None or key.encryptions >= ROTATE_AFTER:
                self.rotate(tenant)
                state = self._load(tenant, create=True)
                key = state.keys[state.current_epoch]
            return key

    def note_encryptions(self, key: DataKey, count: int) -> None:
        """Count ``count`` AES-GCM invocations under ``key``; rotate when the bound nears."""
        with self._lock:
            key.encryptions += count
            state = self._tenants.get(key.tenant)
            if state is None:
                return
            state.unflushed += count
            if key.encryptions >= ROTATE_AFTER:
                self.rotate(key.tenant)
            elif state.unflushed >= _COUNT_FLUSH:
                self._update(key.tenant, lambda doc: doc["epochs"][str(key.epoch)].__setitem__(
                    "encryptions", max(doc["epochs"][str(key.epoch)]["encryptions"], key.encryptions)))

    def key_for_read(self, tenant: str, epoch: int, key_id: bytes) -> DataKey | None:
        """The data key a block names, or None if the key store holds no such key -- after one
        re-read of the store if this process had not loaded it (see "Keys from elsewhere")."""
        with self._lock:
            key = self._loaded_key(tenant, epoch, key_id)
            if key is None and self._may_reload_for_missing(tenant):
                self._tenants.pop(tenant, None)  # the next load reads the file, changed or not
                key = self._loaded_key(tenant, epoch, key_id)
            return key

    def _loaded_key(self, tenant: str, epoch: int, key_id: bytes) -> DataKey | None:
        state = self._load(tenant, create=False)
        key = state.keys.get(epoch) if state is not None else None
        if key is None or not hmac.compare_digest(key.key_id, key_id):
            return None
        return key

    def _may_reload_for_missing(self, tenant: str) -> bool:
        """Rate limit of the re-reads a missing key forces (per tenant)."""
        now = time.monotonic()
        last = self._missing_reloads.get(tenant)
        if last is not None and now - last < self.missing_reload_s:
            return False
        self._missing_reloads[tenant] = now
        self.missing_key_reloads += 1
        return True

    def index_key(self, tenant: str) -> bytes:
        with self._lock:
            return self._load(tenant, create=True).index_key

    def storage_key(self, tenant: str, block_key: bytes) -> bytes:
        """Keyed name of a block: a listing of shared storage reveals nothing about prompts."""
        return hmac.new(self.index_key(tenant), block_key, hashlib.sha256).digest()

    def epochs(self, tenant: str) -> list[int]:
        with self._lock:
            state = self._load(tenant, create=False)
            return sorted(state.keys) if state else []

    def current_epoch(self, tenant: str) -> int:
        with self._lock:
            return self._load(tenant, create=True).current_epoch

    def rotate(self, tenant: str) -> int:
        """Start a new epoch for writes; returns it. Older epochs stay readable."""
        with self._lock:
            self._load(tenant, create=True)
            new_epoch = {}

            def bump(doc: dict) -> None:
                epoch = max(int(e) for e in doc["epochs"]) + 1 if doc["epochs"] else doc["current_epoch"] + 1
                raw = AESGCM.generate_key(256)
                doc["epochs"][str(epoch)] = {"key": self._wrap(tenant, f"data/{epoch}", raw), "created": time.time(), "encryptions": 0}
                doc["current_epoch"] = epoch
                new_epoch["value"] = epoch

            self._update(tenant, bump)
            return new_epoch["value"]

    def retire(self, tenant: str, epoch: int) -> bool:
        """Delete an epoch's data key: its blocks are unreadable everywhere from now on."""
        with self._lock:
            removed = {}

            def drop(doc: dict) -> None:
                removed["ok"] = doc["epochs"].pop(str(epoch), None) is not None

            self._update(tenant, drop)
            return removed.get("ok", False)

    def retire_older_than(self, tenant: str, max_age_s: float) -> list[int]:
        """Retention: retire every epoch older than ``max_age_s`` except the current one."""
        with self._lock:
            state = self._load(tenant, create=False)
            if state is None:
                return []
            now = time.time()
            old = [e for e, t in state.created.items() if now - t > max_age_s and e != state.current_epoch]
            if state.current_epoch in state.created and now - state.created[state.current_epoch] > max_age_s:
                self.rotate(tenant)
                old.append(state.current_epoch)
            for epoch in old:
                self.retire(tenant, epoch)
            return sorted(old)

    def shred_tenant(self, tenant: str) -> bool:
        """Delete every key of a tenant: all its blocks, in every tier, become noise."""
        with self._lock:
            fd = self._locked_file(tenant)
            try:
                path = self._file(tenant)
                existed = path.exists()
                if existed:
                    path.unlink()
                    fsync_dir(self.dir)
            finally:
                os.close(fd)
            self._tenants.pop(tenant, None)
            return existed

    def _update(self, tenant: str, mutate) -> None:
        fd = self._locked_file(tenant)
        try:
            doc = self._read_doc(tenant)
            if doc is None:
                return
            mutate(doc)
            self._write_doc(tenant, doc)
        finally:
            os.close(fd)
        self._tenants.pop(tenant, None)  # re-read (with fresh wraps) on next use


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
