"""Prefix lookups from the scheduler process, answered by the worker that owns the store.

With vLLM's multiprocess executor (``vllm serve`` on CPU, tensor parallelism)
the scheduler and the worker live in different processes, and the worker's
host tier is private memory. The worker (TP rank 0) therefore answers lookups
on a Unix socket named after the engine id; the scheduler asks it.

Wire format (no pickle): request ``u32 n`` then ``n`` 32-byte keys; reply
``u32 hit_blocks``. The socket is created mode 0600. A client that cannot get
an answer within ``timeout_s`` (worker busy, gone) counts a miss and
reconnects on its next call.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence

from kvtier.core.keys import KEY_BYTES, BlockKey

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
MAX_KEYS = 1 << 20


def socket_path(engine_id: str) -> str:
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return os.path.join(tempfile.gettempdir(), f"kvtier-lookup-{safe}.sock")


class LookupServer:
    """Serves ``lookup(keys) -> hit_blocks`` on ``path`` from a daemon thread."""

    def __init__(self, path: str, lookup: Callable[[list[BlockKey]], int]) -> None:
        self.path = path
        self._lookup = lookup
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="kvtier-lookup", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
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
                except (ConnectionError, OSError):
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class LookupClient:
    """The scheduler's end. Not thread safe (vLLM's scheduler is one thread)."""

    def __init__(self, path: str, timeout_s: float = 2.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Blocks of ``keys`` the worker's store holds as a prefix; raises OSError if it cannot tell."""
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        try:
            self._sock.sendall(_U32.pack(len(keys)) + b"".join(keys))
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
