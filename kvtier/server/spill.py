"""What a block spilled to the server's disk says about itself, so that a restarted server can index it.

Each block the server writes to ``disk_dir`` carries, in the disk file's record
(:mod:`kvtier.tiers.disk`), a :class:`SpillAnnotation`: owner (tenant or shared
namespace), namespace, the client's key, session, creation time (wall clock:
monotonic time does not survive a restart), the block header the server serves,
the parent's storage key, the payload size and, for a block a tenant wrote into
a shared namespace, that tenant (its payer: the quota it is charged under). At
start the server rebuilds its :class:`~kvtier.server.index.BlockIndex` from them.

Trust. The disk record's checksum catches accidents (a flipped bit, a record
moved to another key). It is no defence against someone who can write into
``disk_dir``: storage keys are public functions of (tenant, namespace, key), so
without a secret anyone could plant a file that claims to be tenant B's block
and have it served to B. Each annotation is therefore authenticated with
HMAC-SHA256 under a server secret, over the disk key the file is stored under
and the annotation, and the server re-derives that disk key from the claimed
(owner, namespace, key): a planted, altered or moved annotation is rejected and
its file deleted; nothing is served from it. The secret is

* with ``encrypt_at_rest``: derived (HKDF) from the master key, which lives
  outside ``disk_dir``: write access to the disk directory gives nothing;
* otherwise: 32 random bytes in ``<disk_dir>/server.secret``, created 0600 and
  refused if another user owns it or it is readable by group or others (an
  attacker who can replace files in ``disk_dir`` cannot create a file owned by
  the server's user, and one who cannot read it cannot forge a tag). Whoever
  can read that file can forge annotations; with plaintext spill they can read
  the blocks anyway.

Secrecy. With ``encrypt_at_rest`` the payload is sealed and the file named by
the owner's keyed HMAC, so that ``disk_dir`` cannot be linked to prompts; an
annotation in clear would undo that (the client's key is a public function of
namespace and tokens, the served header holds the xxh3 of the plaintext, and
namespace and session names are the tenant's). A codec made from the master key
(:meth:`SpillCodec.for_master_key`) therefore *seals* each annotation:
AES-256-GCM under a key of its own (a random 128-bit salt, HMAC'd with a key
HKDF derives from the master key: one server writes far more than the 2**32
annotations that random 96-bit nonces under one key allow), the disk key in the
AAD. Annotations written before sealing (msgpack + HMAC) are still read, so an
upgrade loses no block; what it writes is sealed. Without a master key the
annotation stays in clear, HMAC'd: the payload beside it is plaintext anyway.

Crypto-shredding. The master key outlives every tenant (all of them need it),
so what it alone opens outlives an erasure: a backup of ``disk_dir`` would still
name an erased tenant's namespaces and sessions and confirm a guessed prompt or
block. The server therefore seals each annotation twice (:meth:`SpillCodec.pack`
with an ``owner_key``): the annotation, whole, under a key of its owner's own
(HKDF of the owner's index key, :meth:`~kvtier.crypto.keyring.Keyring.derived_key`:
``admin erase --tenant`` shreds it with the rest), and that, beside the owner
and the creation time only, under the master key's as above. A restart needs
those two before it can ask the key store (whose block it is; whether an erasure
of the whole owner covers it, :mod:`kvtier.server.recovery`); once the owner's
keys are gone, they are all any copy of the file tells (:class:`OwnerOnly`).
The fleet journal's records are sealed so too (:mod:`kvtier.server.fleet`).
Annotations sealed once (the previous format) and HMAC'd ones are still read.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import msgpack

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.core.framing import frame_str
from kvtier.errors import ConfigError
from kvtier.private_files import (create_private_file, fsync_dir, open_private_file, read_private_file,
                                  replace_private_file)

SECRET_FILE = "server.secret"
_VERSION = 1
_MAC_NBYTES = 32
_DOMAIN = frame_str(1, "kvtier/server-spill/v1")
#: a sealed annotation: this byte, the salt its key derives from, then AES-256-GCM ciphertext and tag
#: (an HMAC'd one starts with msgpack's 9-element array, 0x99)
_SEALED = b"\x02"
_SALT_NBYTES = 16
_SEALED_DOMAIN = frame_str(1, "kvtier/server-spill/sealed/v1")
_ZERO_NONCE = bytes(12)  # each annotation has a key of its own: one message per key
#: an annotation sealed for its owner too: this byte, the salt both its keys derive from, then
#: AES-256-GCM under the master's (outer) of [version, owner, created_wall, inner], where inner is
#: AES-256-GCM under the owner's (:meth:`SpillCodec.pack`) of the whole annotation
_OWNER_SEALED = b"\x03"
_OUTER_DOMAIN = frame_str(1, "kvtier/server-spill/owner-sealed/outer/v1")
_INNER_DOMAIN = frame_str(1, "kvtier/server-spill/owner-sealed/inner/v1")
#: what :meth:`~kvtier.crypto.keyring.Keyring.derived_key` derives the owner's annotation key for
OWNER_KEY_PURPOSE = "spill annotations"
_ERASURES_DOMAIN = frame_str(1, "kvtier/server-erasures/v1")


@dataclass(frozen=True, slots=True)
class SpillAnnotation:
    owner: str
    namespace: str
    key: bytes  #: the client's key (tenant-relative)
    session: str
    created_wall: float  #: time.time() of the block's first commit
    header: bytes  #: the block header the server serves with the block
    nbytes: int  #: payload bytes (plaintext size)
    parent: bytes | None  #: the parent's storage key (server side), if the writer named one
    #: the tenant that wrote a block into a shared namespace, charged under its quota ("": none, or an
    #: annotation written before payers were kept)
    payer: str = ""


class OwnerOnly(NamedTuple):
    """What the master key alone opens of an annotation sealed for its owner too, where the owner's
    key does not open the rest (shredded, or not in this key store): whose block it is and when it
    was made -- enough to judge an erasure of the whole owner -- and nothing of what it holds."""

    owner: str
    created_wall: float


#: ``owner → its annotation key`` (None: the key store holds no keys of the owner's)
OwnerKeys = Callable[[str], "bytes | None"]


def _no_owner_keys(owner: str) -> None:
    return None


class SpillCodec:
    """Packs and checks annotations under one server secret; with a ``seal_key`` (a codec made
    from the master key) it seals them too (see the module's docstring)."""

    def __init__(self, secret: bytes, *, seal_key: bytes | None = None) -> None:
        if len(secret) < 32:
            raise ValueError("a spill secret has at least 32 bytes")
        if seal_key is not None and len(seal_key) != 32:
            raise ValueError("an annotation sealing key has 32 bytes")
        self._secret = secret
        self._seal_key = seal_key

    @classmethod
    def for_master_key(cls, master: bytes) -> "SpillCodec":
        """The codec of a server with encryption at rest: seals what it packs; reads sealed
        annotations and, from before sealing, HMAC'd ones."""
        return cls(secret_from_master_key(master), seal_key=_hkdf(master, b"annotation sealing"))

    @property
    def seals(self) -> bool:
        return self._seal_key is not None

    def erasure_key(self) -> bytes:
        """The key that authenticates the server's erasure records (:mod:`kvtier.server.runtime_state`)."""
        return hmac.new(self._secret, _ERASURES_DOMAIN, hashlib.sha256).digest()

    def _mac(self, disk_key: bytes, body: bytes) -> bytes:
        return hmac.new(self._secret, _DOMAIN + disk_key + body, hashlib.sha256).digest()

    def _sealer(self, salt: bytes, domain: bytes = _SEALED_DOMAIN) -> AESGCM:
        return AESGCM(hmac.new(self._seal_key, domain + salt, hashlib.sha256).digest())

    def pack(self, disk_key: bytes, a: SpillAnnotation, owner_key: bytes | None = None) -> bytes:
        """``a``, authenticated for ``disk_key``: sealed (a sealing codec), for its owner too where
        ``owner_key`` is given (see the module's docstring); else HMAC'd."""
        fields = [_VERSION, a.owner, a.namespace, a.key, a.session, a.created_wall, a.header, a.nbytes, a.parent]
        # The payer trails, and only where there is one: an annotation without it reads as before
        # (here, and in a version before payers, which takes 9 fields only -- a downgrade then drops
        # the shared blocks a tenant wrote, as annotations it cannot read; with encryption at rest, a
        # disk or fleet journal holding only such blocks makes it refuse to start, blaming the master
        # key: README's "Downgrades")
        body = msgpack.packb(fields + [a.payer] if a.payer else fields, use_bin_type=True)
        if self._seal_key is None:
            return body + self._mac(disk_key, body)
        salt = os.urandom(_SALT_NBYTES)
        if owner_key is not None:
            inner = _owner_sealer(owner_key, salt).encrypt(_ZERO_NONCE, body, _inner_aad(disk_key, a.owner))
            outer = msgpack.packb([_VERSION, a.owner, a.created_wall, inner], use_bin_type=True)
            return _OWNER_SEALED + salt + self._sealer(salt, _OUTER_DOMAIN).encrypt(
                _ZERO_NONCE, outer, _OUTER_DOMAIN + _OWNER_SEALED + disk_key)
        return _SEALED + salt + self._sealer(salt).encrypt(_ZERO_NONCE, body, _SEALED_DOMAIN + _SEALED + disk_key)

    def open(self, disk_key: bytes, raw: bytes | None, owner_keys: OwnerKeys) -> SpillAnnotation | OwnerOnly | None:
        """As :meth:`unpack`, and an annotation sealed for its owner too: the annotation where
        ``owner_keys(owner)`` opens it, else only what the master key opens (:class:`OwnerOnly`)."""
        if raw is not None and self._seal_key is not None and raw[:1] == _OWNER_SEALED:
            return self._open_owner_sealed(disk_key, raw, owner_keys)
        return self._unpack_once_sealed_or_hmaced(disk_key, raw)

    def unpack(self, disk_key: bytes, raw: bytes | None) -> SpillAnnotation | None:
        """The annotation if it authenticates for ``disk_key`` (sealed, with a sealing codec; else
        HMAC'd) and is well formed; else None -- None too for one sealed for its owner as well,
        which needs that owner's key (:meth:`open`)."""
        note = self.open(disk_key, raw, _no_owner_keys)
        return note if isinstance(note, SpillAnnotation) else None

    def _open_owner_sealed(self, disk_key: bytes, raw: bytes,
                           owner_keys: OwnerKeys) -> SpillAnnotation | OwnerOnly | None:
        salt, sealed = raw[1:1 + _SALT_NBYTES], raw[1 + _SALT_NBYTES:]
        if len(salt) != _SALT_NBYTES:
            return None
        try:
            outer = self._sealer(salt, _OUTER_DOMAIN).decrypt(_ZERO_NONCE, sealed,
                                                              _OUTER_DOMAIN + _OWNER_SEALED + disk_key)
        except InvalidTag:
            return None
        fields = _fields(outer)
        if not (isinstance(fields, list) and len(fields) == 4 and fields[0] == _VERSION and isinstance(fields[1], str)
                and isinstance(fields[2], (int, float)) and isinstance(fields[3], bytes)):
            return None
        _, owner, created, inner = fields
        found = OwnerOnly(owner, float(created))
        owner_key = owner_keys(owner)
        if owner_key is None:
            return found
        try:
            body = _owner_sealer(owner_key, salt).decrypt(_ZERO_NONCE, inner, _inner_aad(disk_key, owner))
        except InvalidTag:
            return found  # sealed under keys of the owner's that the store no longer holds (shredded, made anew)
        note = _annotation(body)
        # (both layers name the owner and the time: they must agree)
        return note if note is not None and (note.owner, note.created_wall) == found else None

    def _unpack_once_sealed_or_hmaced(self, disk_key: bytes, raw: bytes | None) -> SpillAnnotation | None:
        if raw is None:
            return None
        if self._seal_key is not None and raw[:1] == _SEALED:
            salt, sealed = raw[1:1 + _SALT_NBYTES], raw[1 + _SALT_NBYTES:]
            if len(salt) != _SALT_NBYTES:
                return None
            try:
                body = self._sealer(salt).decrypt(_ZERO_NONCE, sealed, _SEALED_DOMAIN + _SEALED + disk_key)
            except InvalidTag:
                return None
            return _annotation(body)
        if len(raw) <= _MAC_NBYTES:
            return None
        body, tag = raw[:-_MAC_NBYTES], raw[-_MAC_NBYTES:]
        if not hmac.compare_digest(self._mac(disk_key, body), tag):
            return None
        return _annotation(body)


def sealed_for_owner(raw: bytes) -> bool:
    """Whether ``raw`` is an annotation sealed for its owner too (the current format with a master
    key); one that is not, read, is written anew so where its owner's key is there to seal it."""
    return raw[:1] == _OWNER_SEALED


def _owner_sealer(owner_key: bytes, salt: bytes) -> AESGCM:
    """The inner layer's AEAD: a key of its own per annotation (its salt), from the owner's key."""
    return AESGCM(hmac.new(owner_key, _INNER_DOMAIN + salt, hashlib.sha256).digest())


def _inner_aad(disk_key: bytes, owner: str) -> bytes:
    return _INNER_DOMAIN + disk_key + frame_str(2, owner)


def _fields(body: bytes):
    """An authenticated msgpack body, decoded (None if malformed)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=4096, max_str_len=4096,
                               max_array_len=16)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError):
        return None


def _annotation(body: bytes) -> SpillAnnotation | None:
    """An authenticated annotation body, if well formed."""
    fields = _fields(body)
    if not isinstance(fields, list) or len(fields) not in (9, 10) or fields[0] != _VERSION:
        return None
    _, owner, namespace, key, session, created, header, nbytes, parent, *rest = fields
    payer = rest[0] if rest else ""  # (no payer: written before payers were kept, or none)
    if not (isinstance(owner, str) and isinstance(namespace, str) and isinstance(key, bytes) and len(key) == 32
            and isinstance(session, str) and isinstance(created, (int, float)) and isinstance(header, bytes)
            and isinstance(nbytes, int) and nbytes >= 0
            and (parent is None or (isinstance(parent, bytes) and len(parent) == 32)) and isinstance(payer, str)):
        return None
    return SpillAnnotation(owner, namespace, key, session, float(created), header, nbytes, parent, payer)


# -- clocks: the index keeps monotonic time (immune to clock steps); disk keeps wall time ---------
def wall_of(created_monotonic: float) -> float:
    return time.time() - (time.monotonic() - created_monotonic)


def monotonic_of(created_wall: float) -> float:
    """The monotonic time of a past wall-clock instant; a time in the future counts as now
    (a clock stepped back must not make a block younger than new, or expire it early)."""
    age = max(0.0, time.time() - created_wall)
    return time.monotonic() - age


class NewestStamps:
    """Per owner, the newest wall-clock creation stamped on any of its blocks' annotations or fleet
    records (this run's, and those read back at start). An erasure's tombstone covers the blocks
    stamped at or before its time; with the wall clock stepped back since a stamp (an NTP step),
    ``time.time()`` at the erase is older than the newest stamps, so the tombstone is
    never recorded below this (:meth:`~kvtier.server.runtime_state.RuntimeState.record_erasure`).
    Thread safe (the disk tier's and the demotions' threads stamp)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest: dict[str, float] = {}

    def note(self, owner: str, wall: float) -> None:
        with self._lock:
            if wall > self._newest.get(owner, -math.inf):
                self._newest[owner] = wall

    def newest(self, owner: str) -> float:
        """The newest stamp of ``owner``'s blocks (-inf: none)."""
        with self._lock:
            return self._newest.get(owner, -math.inf)


# -- the secret ------------------------------------------------------------------------------
def secret_from_master_key(master: bytes) -> bytes:
    """The HMAC secret of a server with encryption at rest (as before sealing: old files still read)."""
    return _hkdf(master, b"annotations")


def _hkdf(master: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvtier/server-spill/v1", info=info).derive(master)


class SecretRole(NamedTuple):
    """What a server secret keys, as its errors say it (:func:`secret_in`)."""

    what: str  #: its name
    fix: str  #: what to do besides ``chmod 600``
    why: str  #: what it guards


#: ``<disk_dir>/server.secret``: a new one costs the spilled blocks only (their annotations no longer
#: authenticate), which is how an operator drops them on purpose
SPILL_SECRET = SecretRole("the spill secret", "remove it to make a new one (spilled blocks are then dropped at start)",
                          "it authenticates blocks")
#: ``<state_dir>/server.secret`` apart from ``disk_dir``: it keys the records kept there, so a new one
#: would set the erasures' tombstones aside and delete the blocks placed in a fleet; a start that
#: would have to make it over such records is refused (``kvtier.server.server``)
STATE_SECRET = SecretRole(
    "the state secret",
    "restore it: it moves with the state_dir's runtime.json and fleet.journal (removed, the erasures' tombstones "
    "are no longer applied and every block placed in the Mooncake fleet is deleted; a start is refused while "
    "they are there)",
    "it authenticates the erasures' tombstones and the fleet journal's records")


def secret_in(directory: str, role: SecretRole = SPILL_SECRET) -> bytes:
    """The server secret in ``directory`` (made on first use, 0600); refused if anyone else could
    have written or read it, or if it is not 32 bytes (``role`` says, in the errors, what it keys)."""
    path = os.path.join(directory, SECRET_FILE)
    if not os.path.lexists(path):
        create_private_file(path, os.urandom(32))  # False: another starter won; theirs is read below
    secret = read_private_file(path, role.what, role.fix, role.why)
    if not secret:
        _replace_empty_secret(path, role)
        secret = read_private_file(path, role.what, role.fix, role.why)
    if len(secret) != 32:
        raise ConfigError(f"{role.what} {path!r} is not a 32-byte secret; {role.fix}")
    return secret


def would_make_a_secret(directory: str) -> bool:
    """Whether :func:`secret_in` would make a new secret in ``directory``: none there, or an empty
    one (which an older version's crash left; no record was keyed by it)."""
    try:
        st = os.lstat(os.path.join(directory, SECRET_FILE))
    except FileNotFoundError:
        return True
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def _replace_empty_secret(path: str, role: SecretRole) -> None:
    """Replace an empty secret (private, checked by the caller's read) with a new one. An older
    version created the file in place, then wrote it: a crash or a full disk in between left it
    empty, and no block was annotated under it. Under an ``flock`` on the empty file, and only
    while ``path`` still names it: a starter racing this one waits, then reads the new secret."""
    fd = open_private_file(path, role.what, role.fix, role.why)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        if st.st_size == 0 and os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
            replace_private_file(path, os.urandom(32))
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        os.close(fd)  # (releases the lock)
