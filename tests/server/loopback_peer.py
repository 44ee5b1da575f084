"""What the test stand-ins for a kvtier server share (:mod:`tests.server.faulty_peer`,
:mod:`tests.tiers.hostile_server`): a loopback listener, one thread per connection, counters of
connections accepted and closed by the client, and a close that ends them all."""

from __future__ import annotations

import hashlib
import socket
import threading

from kvtier.tiers.remote_protocol import HEADER_NBYTES, unpack_header


def payload_for(key: bytes, nbytes: int) -> bytes:
    """The bytes a stand-in holds for ``key``: derived from it, so a reader can check them."""
    seed = hashlib.sha256(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


class LoopbackPeer:
    """Listens on a loopback port (``url``) and serves each connection on a thread of its own
    (:meth:`_serve`, the subclass's). ``connections`` counts accepted ones, ``closed_by_client``
    those the client closed (subclasses count it where they see the EOF)."""

    def __init__(self, backlog: int = 64) -> None:
        self.connections = 0
        self.closed_by_client = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(backlog)
        self._listener.settimeout(0.05)
        self.url = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._accepter.join(5)
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self._listener.accept()
            except OSError:
                continue
            with self._lock:
                self.connections += 1
                self._socks.append(s)
            t = threading.Thread(target=self._serve, args=(s,), daemon=True)
            self._threads.append(t)
            t.start()

    def _read_frame(self, s: socket.socket):
        """One request frame (header, meta, data), or None once the connection or the peer ends
        (read through the subclass's ``_recv_exact``)."""
        raw = self._recv_exact(s, HEADER_NBYTES)
        if raw is None:
            return None
        h = unpack_header(raw)
        meta = self._recv_exact(s, h.meta_len) if h.meta_len else b""
        data = self._recv_exact(s, h.data_len) if h.data_len else b""
        if meta is None or data is None:
            return None
        return h, meta, data

    def _recv_exact(self, s: socket.socket, n: int) -> bytes | None:
        raise NotImplementedError

    def _serve(self, s: socket.socket) -> None:
        raise NotImplementedError
