"""Envelope keys: master → per-tenant KEK (HKDF) → per-(tenant, epoch) data keys, stored wrapped.

* A tenant's data keys and its index key (for keyed storage names) are random,
  wrapped with the tenant's KEK (AES-GCM, AAD = tenant and purpose) and kept in
  one JSON file per tenant in ``keystore_dir``. The master key never touches data.
* Rotation: :meth:`Keyring.rotate` starts a new epoch; new writes use it, older
  epochs stay readable until :meth:`Keyring.retire` deletes their wrapped key.
* Crypto-shredding: retiring an epoch or :meth:`Keyring.shred_tenant` deletes
  keys, so every block sealed under them becomes unreadable at once, in every
  tier, files still on disk included -- and so does what was sealed under a key
  derived from the tenant's (:meth:`Keyring.derived_key`: the server's spill
  annotations, :mod:`kvtier.server.spill`).
* One nonce budget per data key, for every process sharing the key store: a
  writer reserves the AES-GCM invocations (chunks) it is about to make
  (:meth:`Keyring.key_for_write` ``encryptions=``) *before* it makes them, out of a
  lease of up to ``lease_size`` it took from the store; the store's file records,
  per data key, how many encryptions have ever been leased, and a lease is only
  granted while that total stays within ``rotate_after`` (default
  :data:`ROTATE_AFTER` = 2^30, well below AES-GCM's random-nonce bound of 2^32).
  The writer that finds a key's budget spent rotates, under the same lock, so all
  processes together never exceed the bound under one key. A lease is durable
  before any encryption under it; a process that dies loses the unspent rest
  (wasted, never reused), and unspent leases are never handed back. A leased
  budget is one process's: a child forked from it starts with no lease (and
  re-reads its keys), so it takes its own from the store.
* Several processes may share a keystore directory: writes are atomic
  (temp + rename, the directory synced) under an ``flock``; a process re-reads a
  tenant's file when it changed (another inode, mtime or size than the one its
  keys were read from), at most every ``refresh_s``, so a shred elsewhere takes
  effect here within ``refresh_s`` (immediately in the shredding process). A
  tenant's first use that races a shred elsewhere creates its keys again.
* The store belongs to one master key, and ``required_by`` refuses a missing or
  empty one, for callers whose data needs the existing store
  (:mod:`kvtier.crypto.keystore_dir`).
* A damaged key file is a :class:`~kvtier.errors.ConfigError` naming it, never
  replaced by new keys: that would shred the tenant.
* A key file that cannot be read fails closed: once ``refresh_s`` has passed
  since the keys were last checked, every call for the tenant raises (the keys
  already loaded are not used) until a read succeeds; the failure is raised
  again without touching the file for ``refresh_s`` (see ``_load_existing``).
* Keys from elsewhere: a read that names an epoch (or key id) this process has
  not loaded -- another process rotated and wrote with the new key -- re-reads
  the tenant's file at once, whatever ``refresh_s`` says, at most once per
  ``missing_reload_s`` per tenant (so a flood of blocks sealed under keys nobody
  here has costs one file read a second, not one per block), and looks again.

Thread safe.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.core.framing import frame_int, frame_str
from kvtier.crypto.providers import MasterKeyProvider
from kvtier.errors import ConfigError
from kvtier.crypto.keystore_dir import KeyStoreDir, locked
from kvtier.crypto.keystore_dir import DAMAGE as _DAMAGE
from kvtier.private_files import fsync_dir, replace_private_file

ROTATE_AFTER = 1 << 30
#: encryptions one lease grants: 2^20 chunks (64 GiB at the stream chunk size) cost one locked
#: key-store write, and a crash wastes at most 1/1024 of a key's budget
LEASE_SIZE = 1 << 20
_GCM_RANDOM_NONCE_BOUND = 1 << 32  # NIST SP 800-38D, random 96-bit IVs


@dataclass(slots=True)
class DataKey:
    tenant: str
    epoch: int
    key_id: bytes
    aead: AESGCM = field(repr=False)
    leased: int = 0  #: encryptions leased under this key by all processes, as of this process's last read


@dataclass(slots=True)
class Lease:
    """Encryptions this process may still make under one data key.

    ``[start, end)`` is the latest grant's share of the store's count for the key: no
    other process, before or after, is granted any of it. ``remaining`` may include the
    unspent tail of an earlier grant under the same key."""

    epoch: int
    key_id: bytes
    start: int
    end: int
    remaining: int


class _Read(NamedTuple):
    """A tenant's key file as read through one descriptor: ``doc`` (None: absent) and the
    ``version`` (inode, mtime, size) of the very file the content came from."""

    doc: dict | None
    version: tuple[int, int, int] | None


def _version(st: os.stat_result) -> tuple[int, int, int]:
    # A rewrite is a rename of a new inode over the file, so the inode alone tells a change
    # from the file this process read; mtime and size guard against inode numbers reused.
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _leased(entry: dict) -> int:
    # "encryptions": what key stores written before leases recorded (a lower bound of use)
    return int(entry.get("leased", entry.get("encryptions", 0)))


@dataclass(slots=True)
class _TenantKeys:
    version: tuple[int, int, int]
    checked: float
    current_epoch: int
    keys: dict[int, DataKey]
    index_key: bytes = field(repr=False)
    created: dict[int, float]
    #: purpose → the key :meth:`Keyring.derived_key` derived from ``index_key`` for it
    derived: dict[str, bytes] = field(default_factory=dict, repr=False)


class _FailedRead(NamedTuple):
    """A tenant's key file that could not be read: when, and what was raised (see ``_load_existing``)."""

    at: float
    error: Exception


#: every live keyring of this process, for the fork hook below (weak: a keyring's life is its owner's)
_KEYRINGS: weakref.WeakSet[Keyring] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for keyring in list(_KEYRINGS):
        keyring._forked()


# One hook for every keyring (a hook cannot be unregistered, so not one per keyring).
os.register_at_fork(after_in_child=_after_fork_in_child)


class Keyring:
    def __init__(self, provider: MasterKeyProvider, keystore_dir: str | Path, *, refresh_s: float = 1.0,
                 missing_reload_s: float = 1.0, rotate_after: int = ROTATE_AFTER,
                 lease_size: int = LEASE_SIZE, required_by: str | None = None) -> None:
        """``rotate_after``: encryptions (chunks) under one data key, all processes sharing
        ``keystore_dir`` together, after which writes use a new epoch; every process sharing
        the store must use the same value. ``lease_size``: encryptions taken from the store
        at a time (clipped to ``rotate_after``). ``required_by``: what needs the store to
        exist already (say, blocks sealed with it); a missing or empty store is then refused
        instead of created. Raises :class:`ConfigError` if the store is another master key's."""
        if not 1 <= rotate_after <= _GCM_RANDOM_NONCE_BOUND:
            raise ConfigError(f"rotate_after={rotate_after}: give 1..2^32 encryptions per data key "
                              f"(AES-GCM's random-nonce bound); default 2^30")
        if lease_size < 1:
            raise ConfigError(f"lease_size={lease_size}: give at least 1 encryption per lease")
        self.rotate_after = rotate_after
        self.lease_size = min(lease_size, rotate_after)
        self._master = provider.master_key()
        self.dir = Path(keystore_dir)
        self._store = KeyStoreDir(self.dir, self._master, required_by)
        self.refresh_s = refresh_s
        self.missing_reload_s = missing_reload_s
        self._lock = threading.RLock()
        self._tenants: dict[str, _TenantKeys] = {}
        self._missing_reloads: dict[str, float] = {}  # tenant -> when a missing key last forced a re-read
        self._failed_reads: dict[str, _FailedRead] = {}  # tenant -> its key file's last failed read
        self._leases: dict[str, Lease] = {}  # tenant -> what this process may still encrypt, and under which key
        self.leases_taken = 0  #: leases this process took from the store (observability, tests)
        self.missing_key_reloads = 0  #: re-reads forced by a missing key (observability, tests)
        _KEYRINGS.add(self)

    def _forked(self) -> None:
        """In a child just forked: the parent's lease is the parent's to spend (a child spending it
        too would make more encryptions under the key than the store ever granted), so the child
        takes its own from the store; its cached keys are re-read, and the lock is new (a thread of
        the parent, gone here, may have held it at the fork)."""
        self._lock = threading.RLock()
        self._leases = {}
        self._tenants = {}
        self._missing_reloads = {}
        self._failed_reads = {}

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
        """A key from the tenant's file; :class:`ConfigError` naming the file if it does not open."""
        try:
            blob = base64.b64decode(text)
            return self._kek(tenant).decrypt(blob[:12], blob[12:], frame_str(1, tenant) + frame_str(2, purpose))
        except _DAMAGE as exc:
            raise self._damaged(tenant, exc) from None

    # -- persistence ------------------------------------------------------------
    def _locked_file(self, tenant: str) -> int:
        return locked(self._file(tenant).with_suffix(".lock"))

    def _damaged(self, tenant: str, exc: BaseException) -> ConfigError:
        path = self._file(tenant)
        return ConfigError(f"key store file {path} is damaged or not this master key's ({type(exc).__name__}: "
                           f"{exc}); restore it from a backup -- do not delete it: that shreds the tenant")

    def _read_doc(self, tenant: str) -> _Read:
        """The tenant's key file, content and version from one open (see :class:`_Read`)."""
        try:
            f = open(self._file(tenant), "rb")
        except FileNotFoundError:
            return _Read(None, None)
        with f:
            version = _version(os.fstat(f.fileno()))
            data = f.read()
        try:
            doc = json.loads(data)
            if not (isinstance(doc.get("epochs"), dict) and isinstance(doc.get("current_epoch"), int)
                    and isinstance(doc.get("index_key"), str)):
                raise ValueError("not a key document")
        except _DAMAGE as exc:
            raise self._damaged(tenant, exc) from None
        return _Read(doc, version)

    def _write_doc(self, tenant: str, doc: dict) -> None:
        """Replace the tenant's file (caller holds its lock); durable on return: a rename the
        crash undoes would bring back a retired key, or hand out a lease twice."""
        replace_private_file(self._file(tenant), json.dumps(doc).encode())
        fsync_dir(self.dir)

    def _load(self, tenant: str, *, create: bool) -> _TenantKeys | None:
        """The tenant's keys, re-read if the file changed; created if absent and ``create``
        (then never None: a shred elsewhere between the creation and the read-back of the
        file, which another process may do, only means creating them again)."""
        state = self._load_existing(tenant)
        while state is None and create:
            self._create_if_absent(tenant)
            state = self._load_existing(tenant)
        return state

    def _create_if_absent(self, tenant: str) -> None:
        fd = self._locked_file(tenant)
        try:
            if self._read_doc(tenant).doc is None:
                self._write_doc(tenant, self._new_doc(tenant))
        finally:
            os.close(fd)

    def _load_existing(self, tenant: str, *, reread: bool = False) -> _TenantKeys | None:
        """The tenant's keys, re-read if the file changed (``reread``: re-read now, changed or not);
        None if the store holds none. Keys checked less than ``refresh_s`` ago are used without a
        look at the file (a forced re-read that raised leaves them to the others until then). After
        that, a file that cannot be looked at or read (``stat`` or the read raises: EIO, ESTALE, a
        damaged or unreadable rewrite, EMFILE) fails every call for the tenant -- the keys already
        loaded included -- until a read succeeds; the failure is raised again, without touching the
        file, for ``refresh_s`` (a broken or hung key store is asked once per ``refresh_s``, not at
        every block)."""
        now = time.monotonic()
        cached = None if reread else self._tenants.get(tenant)
        if cached is not None and now - cached.checked < self.refresh_s:
            return cached
        failed = None if reread else self._failed_reads.get(tenant)  # (forced: missing_reload_s limits it)
        if failed is not None and now - failed.at < self.refresh_s:
            raise copy.copy(failed.error)  # (a copy: each caller's traceback its own)
        # Fail closed, not on the keys loaded: a file this process cannot read may be a retirement's
        # rewrite (a new file, its read failing) or, on a shared mount, a shredded one (ESTALE), and
        # a retired or shredded key must never go on opening blocks here, however long the store
        # stays unreadable. The cost is misses (ERROR) while it does, never a key that must be gone.
        try:
            state = self._read_existing(tenant, cached, now)
        except Exception as exc:
            self._failed_reads[tenant] = _FailedRead(now, exc)
            raise
        self._failed_reads.pop(tenant, None)
        return state

    def _read_existing(self, tenant: str, cached: _TenantKeys | None, now: float) -> _TenantKeys | None:
        """:meth:`_load_existing`'s look at the file: the keys ``cached`` if it did not change, else
        read again (None: the file is gone, shredded)."""
        path = self._file(tenant)
        if cached is not None and self._current_version(path) == cached.version:
            cached.checked = now
            return cached
        for _ in range(3):  # the keys are cached under the version they were read from, so a
            # change that lands while they are unwrapped is seen at the next look in any case;
            # reading again now only spares the caller keys that are already stale
            read = self._read_doc(tenant)
            if read.doc is None:
                self._tenants.pop(tenant, None)
                return None
            state = self._parse(tenant, read, now)
            if self._current_version(path) == read.version:
                break
        self._tenants[tenant] = state
        self._store.opened(path.name)  # a key file from before the check: the key is this store's
        return state

    @staticmethod
    def _current_version(path: Path) -> tuple[int, int, int] | None:
        try:
            return _version(path.stat())
        except FileNotFoundError:
            return None

    def _parse(self, tenant: str, read: _Read, now: float) -> _TenantKeys:
        doc = read.doc
        try:
            keys = {}
            created = {}
            for text_epoch, entry in doc["epochs"].items():
                epoch = int(text_epoch)
                raw = self._unwrap(tenant, f"data/{epoch}", entry["key"])
                keys[epoch] = DataKey(tenant, epoch, self._key_id(tenant, epoch, raw), AESGCM(raw), _leased(entry))
                created[epoch] = float(entry["created"])
            index_key = self._unwrap(tenant, "index", doc["index_key"])
        except ConfigError:
            raise  # _unwrap's, already naming the file
        except _DAMAGE as exc:
            raise self._damaged(tenant, exc) from None
        return _TenantKeys(version=read.version, checked=now, current_epoch=doc["current_epoch"], keys=keys,
                           index_key=index_key, created=created)

    def _new_doc(self, tenant: str) -> dict:
        index_key = self._wrap(tenant, "index", os.urandom(32))
        doc = {"version": 1, "current_epoch": -1, "index_key": index_key, "epochs": {}}
        self._add_epoch(tenant, doc)
        return doc

    def _add_epoch(self, tenant: str, doc: dict) -> int:
        """Make a new data key the current one in ``doc``; returns its epoch. Epochs are never
        reused, even after a retirement: a block names its key by epoch."""
        epoch = max([int(e) for e in doc["epochs"]] + [doc["current_epoch"]]) + 1
        raw = AESGCM.generate_key(256)
        doc["epochs"][str(epoch)] = {"key": self._wrap(tenant, f"data/{epoch}", raw), "created": time.time(),
                                     "leased": 0}
        doc["current_epoch"] = epoch
        return epoch

    # -- public API -----------------------------------------------------------------
    def key_for_write(self, tenant: str, encryptions: int = 1) -> DataKey:
        """The current data key, with ``encryptions`` AES-GCM invocations (chunks) under it
        reserved for the caller, who must make no more than that under it. Takes a lease
        from the store when this process's runs out; rotates when the key's budget is spent."""
        if not 1 <= encryptions <= self.rotate_after:
            raise ValueError(f"encryptions={encryptions}: reserve 1..{self.rotate_after} (rotate_after) at a time")
        with self._lock:
            state = self._load(tenant, create=True)
            lease = self._leases.get(tenant)
            key = state.keys.get(lease.epoch) if lease is not None else None
            usable = (key is not None and lease.epoch == state.current_epoch and key.key_id == lease.key_id
                      and lease.remaining >= encryptions)
            while not usable:  # out of budget, or the key rotated / was retired elsewhere since the lease
                lease = self._take_lease(tenant, encryptions, lease)
                key = self._load(tenant, create=True).keys.get(lease.epoch)
                usable = key is not None and key.key_id == lease.key_id  # (else retired in between: again)
            lease.remaining -= encryptions  # the fast path: no I/O, no cross-process lock
            return key

    def _take_lease(self, tenant: str, encryptions: int, old: Lease | None) -> Lease:
        """A lease that covers ``encryptions`` under the store's current key, or a new key's.

        The count lives in the tenant's key-store file and is changed under the flock that
        already serialises every change to that file (rotation, retirement, shredding), so a
        lease and the rotation that follows a spent budget are one atomic step, and two
        processes cannot both be granted the same part of a key's budget. The kernel drops
        an flock when its holder dies, so a killed process never leaves the store locked; and
        the file is renamed into place and its directory synced before any encryption under
        the lease, so a crash (even of the machine) can waste a lease, never grant it twice.
        One write per ``lease_size`` encryptions keeps the cost off the encryption path."""
        fd = self._locked_file(tenant)
        try:
            doc = self._read_doc(tenant).doc
            if doc is None:  # shredded elsewhere since we loaded it: start afresh, as a first write would
                doc = self._new_doc(tenant)
            epoch = doc["current_epoch"]
            entry = doc["epochs"].get(str(epoch))
            key_id = self._key_id(tenant, epoch, self._unwrap(tenant, f"data/{epoch}", entry["key"])) if entry else None
            carried = old.remaining if old is not None and old.epoch == epoch and old.key_id == key_id else 0
            leased = _leased(entry) if entry is not None else self.rotate_after
            need = encryptions - carried
            if leased + need > self.rotate_after:  # this key's budget is spent: rotate
                epoch = self._add_epoch(tenant, doc)
                entry = doc["epochs"][str(epoch)]
                key_id = self._key_id(tenant, epoch, self._unwrap(tenant, f"data/{epoch}", entry["key"]))
                leased, carried, need = 0, 0, encryptions
            grant = max(need, min(self.lease_size, self.rotate_after - leased))
            entry["leased"] = leased + grant
            entry.pop("encryptions", None)
            self._write_doc(tenant, doc)  # durable before any encryption under the lease
        finally:
            os.close(fd)
        self._tenants.pop(tenant, None)  # re-read (the new count, perhaps a new key) on next use
        lease = Lease(epoch, key_id, leased, leased + grant, carried + grant)
        self._leases[tenant] = lease
        self.leases_taken += 1
        return lease

    def lease(self, tenant: str) -> Lease | None:
        """This process's lease for ``tenant``'s writes (a copy), or None before its first write."""
        with self._lock:
            lease = self._leases.get(tenant)
            return None if lease is None else Lease(lease.epoch, lease.key_id, lease.start, lease.end, lease.remaining)

    def leased(self, tenant: str) -> dict[int, int]:
        """Encryptions leased so far under each of ``tenant``'s data keys, all processes
        together, read from the store now: epoch -> count."""
        with self._lock:
            doc = self._read_doc(tenant).doc
            return {} if doc is None else {int(e): _leased(entry) for e, entry in doc["epochs"].items()}

    def key_for_read(self, tenant: str, epoch: int, key_id: bytes) -> DataKey | None:
        """The data key a block names, or None if the key store holds no such key -- after one
        re-read of the store if this process had not loaded it (see "Keys from elsewhere")."""
        with self._lock:
            key = self._loaded_key(tenant, epoch, key_id)
            if key is None and self._may_reload_for_missing(tenant):
                self._load_existing(tenant, reread=True)
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

    def retired_any(self, tenant: str) -> bool:
        """Whether an epoch of ``tenant`` was retired: else no block of it can be sealed under a
        retired key (cheap, from what is loaded: epochs are 0..current, never reused)."""
        with self._lock:
            state = self._load(tenant, create=False)
            return state is None or len(state.keys) <= state.current_epoch

    def retired(self, tenant: str, epoch: int) -> bool:
        """Whether ``epoch`` of ``tenant`` was retired or shredded: no key store will hold its key
        again, so a block sealed under it can never be read (unlike a newer epoch from elsewhere)."""
        with self._lock:
            state = self._load(tenant, create=False)
            return state is None or (epoch not in state.keys and epoch <= state.current_epoch)

    def index_key(self, tenant: str) -> bytes:
        with self._lock:
            return self._load(tenant, create=True).index_key

    def storage_key(self, tenant: str, block_key: bytes) -> bytes:
        """Keyed name of a block: a listing of shared storage reveals nothing about prompts."""
        return hmac.new(self.index_key(tenant), block_key, hashlib.sha256).digest()

    def existing_storage_key(self, tenant: str, block_key: bytes) -> bytes | None:
        """:meth:`storage_key`, or None if the store holds no keys of ``tenant``; never creates
        them (for checking names found on disk: no block can carry a tenant's name before its
        keys exist, and a check must write nothing)."""
        with self._lock:
            state = self._load(tenant, create=False)
            return None if state is None else hmac.new(state.index_key, block_key, hashlib.sha256).digest()

    def derived_key(self, tenant: str, purpose: str) -> bytes | None:
        """A 32-byte key of ``tenant``'s own for ``purpose``, derived (HKDF) from its index key, so
        that :meth:`shred_tenant` destroys it with the rest; None if the store holds no keys of
        ``tenant``'s. Never creates them: what was sealed under the keys shredded must not open under
        keys made anew."""
        with self._lock:
            state = self._load(tenant, create=False)
            if state is None:
                return None
            if purpose not in state.derived:
                hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvtier/tenant-derived/v1",
                            info=frame_str(1, purpose))
                state.derived[purpose] = hkdf.derive(state.index_key)
            return state.derived[purpose]

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
                new_epoch["value"] = self._add_epoch(tenant, doc)

            self._update(tenant, bump, create=True)  # shredded elsewhere meanwhile: start afresh
            self._leases.pop(tenant, None)  # the rest of our lease was for the old key
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
                path.unlink(missing_ok=True)
                # a writer that died before its rename left the whole key document in a temp file
                leftovers = list(self.dir.glob(f"{path.stem}.tmp*"))
                for leftover in leftovers:
                    leftover.unlink(missing_ok=True)
                if existed or leftovers:
                    fsync_dir(self.dir)
            finally:
                os.close(fd)
            self._tenants.pop(tenant, None)
            self._leases.pop(tenant, None)
            return existed

    def _update(self, tenant: str, mutate, *, create: bool = False) -> None:
        """``mutate`` the tenant's document under its lock and write it back; if the tenant is
        gone (shredded), a new document is mutated if ``create``, else nothing happens."""
        fd = self._locked_file(tenant)
        try:
            doc = self._read_doc(tenant).doc
            if doc is None:
                if not create:
                    return
                doc = self._new_doc(tenant)
            mutate(doc)
            self._write_doc(tenant, doc)
        finally:
            os.close(fd)
        self._tenants.pop(tenant, None)  # re-read (with fresh wraps) on next use
