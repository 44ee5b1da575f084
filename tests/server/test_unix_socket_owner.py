"""A server's unix socket belongs to the server that bound it.

``Server.start`` removed whatever socket sat at its unix path ("a stale socket of a previous
run") without asking whether a live server listened there, and ``Server.close`` removed the path
whether or not the socket there was still its own. Two ``kvtier serve`` on one path (a restart
begun before the old one stopped, a second launch by mistake): the first silently lost its unix
listener, and when it stopped it removed the second's socket, so the running server was
unreachable. Now a live socket refuses the second start, and a stop removes only its own socket.
"""

from __future__ import annotations

import os
import signal
import socket

import pytest

from kvtier.server.launch import ServerProcess
from tests.server.harness import SHARED, TOKENS, tenants


def _answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _start(workdir: str) -> ServerProcess:
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], unix=True, workdir=workdir,
                              timeout_s=30)
    srv.own_workdir = False
    return srv


def test_a_second_server_on_a_live_servers_unix_path_is_refused(tmp_path):
    workdir = str(tmp_path)
    path = os.path.join(workdir, "kvtier.sock")
    first = _start(workdir)
    try:
        inode = os.stat(path).st_ino
        with pytest.raises(RuntimeError, match="another server listens"):
            _start(workdir)
        assert os.stat(path).st_ino == inode and _answers(path), "the live server's socket was taken over"
    finally:
        first.stop()
    assert not os.path.exists(path)   # control: a server's stop removes its own socket


def test_a_dead_servers_socket_is_replaced_and_a_stop_leaves_anothers_socket(tmp_path):
    """Control: a socket nobody listens on (its server SIGKILLed) is stale and replaced. And a stop
    removes the path only while it is still the socket this server bound."""
    workdir = str(tmp_path)
    path = os.path.join(workdir, "kvtier.sock")
    dead = _start(workdir)
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(10)
    assert os.path.exists(path) and not _answers(path)
    second = _start(workdir)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert _answers(path)
        # someone else's socket now sits at the path (as if a later server had taken it over)
        os.unlink(path)
        other.bind(path)
        other.listen(1)
        second.stop()
        assert os.path.exists(path) and _answers(path), "a stop removed a socket it did not bind"
    finally:
        second.stop()
        other.close()
