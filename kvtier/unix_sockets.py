"""Whether a Unix socket file has a live listener: the one test every kvtier process that binds a
socket path (the server, the vLLM connector's lookup service) makes before replacing a file there.

A socket file says nothing of whether anyone listens on it. Only a refused connection (or a
file gone meanwhile) shows a stale one; any other failure is counted as live: a full backlog
times out, another user's socket refuses us with EACCES, and removing either would take a
running process's path from under it.
"""

from __future__ import annotations

import socket


def socket_is_live(path: str, timeout_s: float = 1.0) -> bool:
    """True unless a connection to the socket at ``path`` is refused (stale) or it is gone."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True
