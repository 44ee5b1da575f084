"""``socket_is_live``: only a refused connection marks a socket file stale (real Unix sockets)."""

from __future__ import annotations

import socket

from kvtier.unix_sockets import socket_is_live


def test_a_listener_is_live_and_a_left_socket_file_is_stale(tmp_path):
    path = str(tmp_path / "s.sock")
    assert not socket_is_live(path)  # no file
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    assert socket_is_live(path)  # positive control
    srv.close()  # the file stays, nobody listens
    assert not socket_is_live(path)


def test_a_listener_whose_backlog_is_full_counts_as_live(tmp_path):
    """A busy listener (its backlog full: the connection times out) is not stale: removing its
    socket file would take a running process's path from under it."""
    path = str(tmp_path / "busy.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    waiting = []
    try:
        for _ in range(8):  # fill the backlog without accepting
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            waiting.append(c)
        assert socket_is_live(path, timeout_s=0.2)
    finally:
        for c in waiting:
            c.close()
        srv.close()
