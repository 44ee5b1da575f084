"""Prefix lookups from the scheduler process, answered by the worker that owns the store.

With vLLM's multiprocess executor (``vllm serve`` on CPU, tensor parallelism)
the scheduler and the worker live in different processes, and the worker's
host tier is private memory. The worker (TP rank 0; with pipeline parallelism,
of each stage) therefore answers lookups on a Unix socket named after the engine
id and its stage; the scheduler asks stage 0's. The name is a SHA-256 digest of
the two: every id gets its own socket however long, whatever its characters
(vLLM's data-parallel ranks are ``<engine_id>_dp<rank>``), and the path stays short.

Wire format (no pickle): request ``u32 n`` then ``n`` 32-byte keys; reply
``u32 hit_blocks``. A client that cannot get an answer within ``timeout_s``
(worker busy, gone) counts a miss and reconnects on its next call.

What a connection may hold in the worker: a thread and a descriptor each, so the
server closes a connection idle for ``idle_timeout_s`` and serves at most
``max_connections`` at once (past it, a new one is closed at once); the client
asks again once on a new connection where the worker closed its idle one. A
failed accept (descriptors or threads run out: a flood of connections) is
waited out, never the end of the server.

Who may talk to whom. A hit tells which prompts were seen, and a lying server
could make the scheduler plan loads of blocks that do not exist, so:

* the socket lives in a directory private to the user (:func:`lookup_dir`:
  ``$XDG_RUNTIME_DIR/kvtier``, else ``<tmp>/kvtier-<uid>``), created 0700 and
  used only if it is a real directory this user owns -- never a predictable
  path in a shared ``/tmp`` that another user could create first;
* each end checks the other's ``SO_PEERCRED``: a peer of another uid is
  closed (server) or refused (client);
* whatever sits at the socket path already (a stale socket, a file, a
  directory) is replaced or, if it cannot be, the worker serves no lookups
  and says why: the scheduler then counts misses, the engine keeps running.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.errors import ConfigError
from kvtier.unix_sockets import socket_is_live

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_KEYS = 1 << 20
#: the longest path a Unix socket can be bound at (``sun_path`` is 108 bytes on Linux, NUL included)
MAX_SOCKET_PATH = 107
#: hex digits of SHA-256 in a socket's name: 128 bits, no collision between engine ids to fear
_DIGEST_HEX = 32
_NAME_BYTES = len("/lookup-.sock") + _DIGEST_HEX
#: a connection that sends no request for this long is closed (the scheduler's client reconnects)
IDLE_TIMEOUT_S = 60.0
#: connections served at once: one per scheduler is the use, each holds a thread and a descriptor
MAX_CONNECTIONS = 64
#: the pause after a failed accept or thread start before accepting again (descriptors or threads
#: ran out: those of connections that end come back)
_ACCEPT_RETRY_S = 0.05
#: accept failures that the connections ending cure (descriptors, memory): logged as errors
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: a repeating condition of the accept loop is logged at most once in this many seconds
_SAY_EVERY_S = 60.0


def lookup_dir(env: Mapping[str, str] | None = None) -> str | None:
    """This user's private directory for lookup sockets (created 0700); None if none can be trusted."""
    env = os.environ if env is None else env
    candidates = []
    if env.get("XDG_RUNTIME_DIR"):
        candidates.append(os.path.join(env["XDG_RUNTIME_DIR"], "kvtier"))
    candidates.append(os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}"))
    for path in candidates:
        if _private_dir(path):
            return path
    return None


def _private_dir(path: str) -> bool:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.debug("kvtier lookup: cannot create %s (%s)", path, exc)
        return False
    st = os.lstat(path)  # lstat: a symlink planted by someone else is not followed
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        log.error("kvtier lookup: %s is not a directory owned by this user (uid %d) but a %s of uid %d; "
                  "not using it for the lookup socket (remove it, or set XDG_RUNTIME_DIR)",
                  path, os.getuid(), _kind(st.st_mode), st.st_uid)
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours: make it private (mkdir's mode went through the umask)
    return True


def socket_path(engine_id: str, env: Mapping[str, str] | None = None, *, pp_rank: int = 0) -> str | None:
    """Where the worker of ``engine_id`` (of pipeline stage ``pp_rank``) answers lookups; None if
    there is no private directory. Raises ConfigError if the directory leaves no room for the name.

    Named by a SHA-256 digest of both: distinct ids (or stages) never share a socket, however long
    the id and whatever its characters."""
    directory = lookup_dir(env)
    if directory is None:
        return None
    name = json.dumps([engine_id, pp_rank])   # one string per pair, whatever the id holds
    digest = hashlib.sha256(name.encode()).hexdigest()[:_DIGEST_HEX]
    path = os.path.join(directory, f"lookup-{digest}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        # bind() would fail and the engine count misses, the reason only in a log line
        raise ConfigError(
            f"kvtier's lookup socket {path} would be {len(os.fsencode(path))} bytes, over the {MAX_SOCKET_PATH} "
            f"a Unix socket path may have: the directory {directory} is too long. Set XDG_RUNTIME_DIR (or, "
            f"without it, TMPDIR) to a directory of at most {MAX_SOCKET_PATH - _NAME_BYTES - len('/kvtier')} "
            f"bytes, e.g. /run/user/{os.getuid()}")
    return path


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (Linux ``SO_PEERCRED``)."""
    return _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def peer_allowed(credentials: tuple[int, int, int], uid: int | None = None) -> bool:
    """Only processes of this user (``uid``) may ask or answer lookups."""
    _, peer_uid, _ = credentials
    return peer_uid == (os.getuid() if uid is None else uid)


class LookupServer:
    """Serves ``lookup(keys) -> hit_blocks`` on ``path`` from a daemon thread.

    Never raises for the path: if it cannot serve there, :attr:`serving` is
    False and the reason is logged. A connection idle for ``idle_timeout_s`` is
    closed, one past ``max_connections`` served at once is closed unserved, and
    an accept or thread start that fails is retried until :meth:`close`.
    """

    def __init__(self, path: str | None, lookup: Callable[[list[BlockKey]], int], *,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        self.path = path
        self._lookup = lookup
        self._closed = False
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._connection_slots = threading.BoundedSemaphore(max_connections)
        self._said_at: dict[str, float] = {}   # topic -> when the accept loop last logged it
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        if path is None:
            log.error("kvtier lookup: no private directory for the lookup socket (see above); schedulers in "
                      "other processes will count misses for this worker")
            return
        self._sock = self._bind(path)
        if self._sock is not None:
            threading.Thread(target=self._accept, args=(self._sock,), name="kvtier-lookup", daemon=True).start()

    @property
    def serving(self) -> bool:
        return self._sock is not None

    def _bind(self, path: str) -> socket.socket | None:
        if not self._clear(path):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
            sock.listen(8)
        except OSError as exc:
            sock.close()
            log.error("kvtier lookup: cannot listen on %s (%s); this worker serves no lookups", path, exc)
            return None
        finally:
            os.umask(old)
        self._inode = os.lstat(path).st_ino
        return sock

    @staticmethod
    def _clear(path: str) -> bool:
        """Make room at ``path``: replace a stale socket or a file; refuse a live socket or a directory."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True
        if stat.S_ISDIR(st.st_mode):
            log.error("kvtier lookup: a directory sits at the socket path %s; this worker serves no lookups "
                      "(remove it)", path)
            return False
        if stat.S_ISSOCK(st.st_mode) and socket_is_live(path):
            log.error("kvtier lookup: another process already serves lookups at %s (the same engine id "
                      "twice?); this worker serves none", path)
            return False
        log.warning("kvtier lookup: replacing the %s of uid %d left at %s", _kind(st.st_mode), st.st_uid, path)
        try:
            os.unlink(path)
        except OSError as exc:
            log.error("kvtier lookup: cannot remove %s (%s); this worker serves no lookups", path, exc)
            return False
        return True

    def _accept(self, listener: socket.socket) -> None:
        """Accept and hand each connection to a thread of its own until :meth:`close`."""
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # Out of descriptors (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM) is temporary: the
                # connections that end give them back. Returning here left the socket unserved for
                # the engine's life, every lookup a miss.
                self._say("accept", "cannot accept a connection (%s); trying again every %.2f s",
                          exc, _ACCEPT_RETRY_S,
                          level=logging.ERROR if exc.errno in _OUT_OF_RESOURCES else logging.WARNING)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own, or close it: another user's, past the cap, or no thread."""
        try:
            credentials = peer_credentials(conn)
        except OSError:
            credentials = (0, -1, -1)
        if not peer_allowed(credentials):
            log.warning("kvtier lookup: refused a connection from pid %d uid %d (not this user)",
                        credentials[0], credentials[1])
            conn.close()
            return
        if not self._connection_slots.acquire(blocking=False):
            self._say("cap", "%d connections served already (max_connections); closing new ones unserved",
                      self._max_connections)
            conn.close()
            return
        conn.settimeout(self._idle_timeout_s)
        try:
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()
        except RuntimeError as exc:   # "can't start new thread": threads ran out, as descriptors may
            self._connection_slots.release()
            conn.close()
            self._say("thread", "cannot start a thread for a connection (%s); closed it, trying again in %.2f s",
                      exc, _ACCEPT_RETRY_S, level=logging.ERROR)
            time.sleep(_ACCEPT_RETRY_S)

    def _say(self, topic: str, what: str, *args, level: int = logging.WARNING) -> None:
        """Log ``what`` at most once a minute per ``topic``: a flood repeats it at each connection."""
        now = time.monotonic()
        said_at = self._said_at.get(topic)
        if said_at is None or now - said_at >= _SAY_EVERY_S:
            self._said_at[topic] = now
            log.log(level, "kvtier lookup: " + what + " (said at most once a minute)", *args)

    def _serve(self, conn: socket.socket) -> None:
        """Answer ``conn``'s requests until it closes, errs or stays idle ``idle_timeout_s`` (a timeout,
        an OSError); then give its slot back."""
        try:
            with conn:
                self._answer_requests(conn)
        finally:
            self._connection_slots.release()

    def _answer_requests(self, conn: socket.socket) -> None:
        while True:
            try:
                head = _recv(conn, 4)
                (n,) = _U32.unpack(head)
                if n > MAX_KEYS:
                    return
                raw = _recv(conn, n * KEY_BYTES)
                keys = [BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]
                try:
                    hit = self._lookup(keys)
                except Exception as exc:  # noqa: BLE001 - a broken tier answers a miss
                    log.warning("kvtier lookup failed (%s); answering a miss", exc)
                    hit = 0
                conn.sendall(_U32.pack(hit))
            except OSError:   # the peer gone, or idle past the timeout (socket.timeout is an OSError)
                return

    def close(self) -> None:
        self._closed = True
        if self._sock is None:
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not)
        except OSError:
            pass
        self._sock.close()
        self._sock = None
        try:
            if os.lstat(self.path).st_ino == self._inode:  # still ours, not a successor's
                os.unlink(self.path)
        except FileNotFoundError:
            pass


class LookupClient:
    """The scheduler's end. Not thread safe (vLLM's scheduler is one thread).

    After a failed call (a timeout: the worker's lookup stuck on a hung tier; a refused
    connection) lookups fail at once for a while, doubling from ``backoff_s`` up to
    ``max_backoff_s`` while they keep failing: the scheduler asks for every waiting request
    on every step, and each call to a stuck worker cost it the whole timeout, stalling every
    request of the engine for seconds a step."""

    def __init__(self, path: str | None, timeout_s: float = 2.0, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._backoff_min, self._backoff_max = backoff_s, max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Blocks of ``keys`` the worker's store holds as a prefix; raises OSError if it cannot tell."""
        if time.monotonic() < self._down_until:
            raise OSError("kvtier lookups back off after a failed one")
        try:
            hit = self._ask(keys)
        except OSError:
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(2 * self._backoff, self._backoff_max)
            raise
        self._backoff = self._backoff_min
        return hit

    def _ask(self, keys: Sequence[BlockKey]) -> int:
        request = _U32.pack(len(keys)) + b"".join(keys)
        if self._sock is not None:
            try:
                return self._exchange(request)
            except ConnectionError:
                # The worker closes a connection idle for its idle_timeout_s (the engine had no
                # request for a minute): asked again once on a new one, not a miss and a backoff.
                # A timeout is no ConnectionError: a stuck worker still costs one timeout, not two.
                pass
        self._sock = self._connect()
        return self._exchange(request)

    def _connect(self) -> socket.socket:
        if self.path is None:
            raise OSError("no private directory for the lookup socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
            credentials = peer_credentials(sock)
            if not peer_allowed(credentials):
                raise PermissionError(f"the lookup socket {self.path} is served by uid {credentials[1]}, "
                                      f"not this user")
        except OSError:
            sock.close()
            raise
        return sock

    def _exchange(self, request: bytes) -> int:
        """Send ``request`` on the open connection, return the reply; closes the connection on any OSError."""
        try:
            self._sock.sendall(request)
            (hit,) = _U32.unpack(_recv(self._sock, 4))
            return hit
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    return "file"
