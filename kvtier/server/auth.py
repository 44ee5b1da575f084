"""Authentication, tenants and key spaces: who a connection is and which blocks it can name.

* A token is never stored: the config holds ``sha256(token)``; a presented token is
  hashed and compared with *every* configured digest with
  :func:`hmac.compare_digest` (constant time, no early exit).
* The tenant comes from the token, never from the client. Every block a
  connection touches lives in a :class:`KeySpace`, and the server stores it
  under ``storage_key = SHA-256(framed domain, kind, owner, namespace, client key)``:
  a client can only ever produce storage keys inside its own spaces, so another
  tenant's block is not hidden but unaddressable -- it answers exactly like an
  absent one because, for this client, it is one.
* A shared namespace (``shared/NAME``) is a separate space owned by no tenant:
  its writers (publishers) may put into it; tenants granted ``read_shared``
  read it, and their reads fall through to it from any of their namespaces.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.core.framing import frame_head, frame_str
from kvtier.server.config import SHARED_PREFIX, ServerConfig, check_namespace

_DOMAIN = "kvtier/server/storage-key/v1"
_T_DOMAIN, _T_KIND, _T_OWNER, _T_NAMESPACE, _T_KEY = 1, 2, 3, 4, 5
ADMIN = "__admin__"
#: key spaces kept ready (LRU); HELLOs may name any number of namespaces, so the cache is bounded
SPACE_CACHE_SIZE = 4096


def hash_token(token: str) -> str:
    """The digest to put in the config for ``token``."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class KeySpace:
    """One tenant namespace or one shared namespace; maps client keys to storage keys."""

    owner: str  #: tenant name, or ``shared/NAME`` for a shared namespace
    namespace: str
    _prefix: "hashlib._Hash" = field(repr=False, compare=False, hash=False)

    @classmethod
    def of(cls, owner: str, namespace: str) -> "KeySpace":
        kind = "shared" if owner.startswith(SHARED_PREFIX) else "tenant"
        h = hashlib.sha256()
        for tag, value in ((_T_DOMAIN, _DOMAIN), (_T_KIND, kind), (_T_OWNER, owner), (_T_NAMESPACE, namespace)):
            h.update(frame_str(tag, value))
        h.update(frame_head(_T_KEY, 32))
        return cls(owner, namespace, h)

    def storage_key(self, client_key: bytes) -> bytes:
        h = self._prefix.copy()
        h.update(client_key)
        return h.digest()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated connection: its tenant, the space it writes, the spaces it reads (in order)."""

    tenant: str
    namespace: str
    is_admin: bool = False
    write_space: KeySpace | None = None  #: None: read-only (or admin)
    read_spaces: tuple[KeySpace, ...] = ()

    @property
    def writable(self) -> bool:
        return self.write_space is not None


class AuthError(Exception):
    """HELLO refused; ``forbidden`` tells a valid token asking for a namespace it may not use."""

    def __init__(self, message: str, *, forbidden: bool = False) -> None:
        super().__init__(message)
        self.forbidden = forbidden


class Authenticator:
    def __init__(self, config: ServerConfig) -> None:
        self._digests: list[tuple[bytes, str]] = [(bytes.fromhex(h), ADMIN) for h in config.admin_token_sha256]
        for t in config.tenants:
            self._digests += [(bytes.fromhex(h), t.name) for h in t.token_sha256]
        self._tenants = {t.name: t for t in config.tenants}
        self._shared = {s.name: s for s in config.shared}
        self._spaces: OrderedDict[tuple[str, str], KeySpace] = OrderedDict()  # LRU, SPACE_CACHE_SIZE at most
        self._spaces_lock = threading.Lock()

    def identify(self, token: str) -> str | None:
        """The tenant name (or :data:`ADMIN`) of ``token``; None if no token matches."""
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found: str | None = None
        for candidate, who in self._digests:  # compare with all, whatever matched
            if hmac.compare_digest(candidate, digest):
                found = who
        return found

    def space(self, owner: str, namespace: str) -> KeySpace:
        key = (owner, namespace)
        with self._spaces_lock:
            ks = self._spaces.get(key)
            if ks is not None:
                self._spaces.move_to_end(key)
                return ks
        ks = KeySpace.of(owner, namespace)  # the same value whenever made: a miss only costs a hash
        with self._spaces_lock:
            self._spaces[key] = ks
            self._spaces.move_to_end(key)
            while len(self._spaces) > SPACE_CACHE_SIZE:
                self._spaces.popitem(last=False)
        return ks

    def shared_space(self, name: str) -> KeySpace:
        return self.space(SHARED_PREFIX + name, name)

    def authenticate(self, token: object, namespace: object) -> Principal:
        """Raise :class:`AuthError` unless ``token`` is valid and may use ``namespace``."""
        if not isinstance(token, str) or not token or len(token) > 1024:
            raise AuthError("HELLO needs a token string")
        who = self.identify(token)
        if who is None:
            raise AuthError("unknown token")
        if who == ADMIN:
            return Principal(tenant=ADMIN, namespace="", is_admin=True)
        if not isinstance(namespace, str):
            raise AuthError("namespace must be a string", forbidden=True)
        try:
            check_namespace(namespace)
        except ValueError as exc:
            raise AuthError(str(exc), forbidden=True) from None
        tenant = self._tenants[who]
        if namespace.startswith(SHARED_PREFIX):
            name = namespace[len(SHARED_PREFIX) :]
            shared = self._shared.get(name)
            if shared is not None and who in shared.writers:
                ks = self.shared_space(name)
                return Principal(who, namespace, write_space=ks, read_spaces=(ks,))
            if shared is not None and name in tenant.read_shared:
                return Principal(who, namespace, read_spaces=(self.shared_space(name),))
            raise AuthError(f"tenant may not use namespace {namespace!r}", forbidden=True)
        own = self.space(who, namespace)
        granted = tuple(self.shared_space(s) for s in tenant.read_shared)
        return Principal(who, namespace, write_space=own, read_spaces=(own, *granted))
