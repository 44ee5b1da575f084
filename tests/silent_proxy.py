"""A TCP forwarder whose connections can die in silence, as a flow does when a host crashes or a
NAT or firewall drops it: nothing more passes, and no FIN or RST reaches either end."""

from __future__ import annotations

import socket
import threading


class SilentProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:upstream_port``. :meth:`blackhole` silences the
    connections open so far (a half-open flow on both sides); connections made later pass again."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.port = self._listener.getsockname()[1]
        self.connections = 0          #: connections accepted so far
        self._generation = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                down.close()          # nobody upstream (restarting): the client reconnects
                continue
            self._sockets += [down, up]
            self.connections += 1
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst, self._generation), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, generation: int) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or self._generation != generation:
                    break
                dst.sendall(data)
        except OSError:
            pass
        if self._generation == generation:      # a real close: passed on
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def blackhole(self) -> None:
        """The connections open so far forward nothing more and close nothing."""
        self._generation += 1

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
