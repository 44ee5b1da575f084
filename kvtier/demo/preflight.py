"""What ``kvtier demo`` checks before it spawns anything, and the leftovers it sweeps.

Bad input (a store directory that cannot be written, a server URL without a token, an
unwritable cache directory) raises :class:`~kvtier.errors.ConfigError` here, in the parent,
so that ``kvtier`` prints one line and exits 2 before a model is loaded, instead of a
worker's traceback after it. Nothing here imports torch.

Directories the demo makes for itself carry the pid of the process that made them
(``demo-store-<pid>-XXXX``): one whose process is gone was left by a run killed too hard to
clean up (SIGKILL, a power cut) and is removed by the next run.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.child_process import owner_pid, owner_tag, remove_dead_dirs

STORE_PREFIX = "demo-store-"


def writable_dir(path: str | os.PathLike, what: str, fix: str = "") -> str:
    """``path``, created if missing, once a file could be made in it; else ConfigError naming ``what``.

    A probe file, not ``os.access``: root passes ``access(W_OK)`` on a read-only mount or in
    ``/proc``, where creating a file still fails."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{what} {path!r} is not a writable directory ({reason}){fix}") from None
    return path


#: how long the preflight waits for the server to answer (connect, HELLO and PING together)
REMOTE_PING_TIMEOUT_S = 3.0


def check_remote(url: str, namespace: str | None = None, timeout_s: float = REMOTE_PING_TIMEOUT_S) -> None:
    """The URL parses, a token is at hand (``$KVTIER_TOKEN`` or in the URL) and the server answers
    one authenticated round trip (HELLO with the token for ``namespace``, then PING) within
    ``timeout_s``; else ConfigError.

    The store treats a server it cannot reach as a tier that misses: without this, a demo given a
    wrong address or token ran without its shared tier and exited 0. A WireClient, not a
    RemoteTier: a tier would log its failure (and back off) besides the one line said here."""
    from kvtier.tiers.remote_protocol import Op
    from kvtier.tiers.remote_wire import WireClient, parse_url, resolve_token

    address = parse_url(url)
    token = resolve_token(address, None)
    deadline = time.monotonic() + timeout_s
    try:
        client = WireClient(address, token, namespace=namespace, connect_timeout_s=timeout_s, deadline=deadline)
        try:
            client.call(Op.PING, deadline=deadline, reply_meta=(0, 0))
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - refused, timed out, bad token, not a kvtier server: all "cannot reach"
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ConfigError(f"cannot reach the kvtier server at --remote {address} ({reason}); start it "
                          f"(`kvtier serve`) or check the URL and $KVTIER_TOKEN") from None


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer of 1 or more."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def sweep_stale(directory: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the directories ``<prefix><pid>-h<host>-*`` (or ``<prefix><pid>-*``, an older kvtier's)
    in ``directory`` whose process of this host is gone; the ones removed.

    A name without a pid, or of another host or container (a shared cache directory), is left
    alone: nothing here says its owner is gone."""
    return remove_dead_dirs(directory, lambda name: owner_pid(name.rpartition("-")[0])
                            if name.startswith(prefix) else None)


def make_store_dir(cache: str | os.PathLike) -> str:
    """A fresh ``demo-store-<pid>-h<host>-XXXX`` under ``cache`` (swept of dead runs' ones first)."""
    sweep_stale(cache, STORE_PREFIX)
    return tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{owner_tag()}-", dir=cache)


@contextmanager
def exit_on_termination():
    """Within it, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)``, so that ``finally`` blocks
    (the worker's stop, the store directory's removal) run: Python's default for them ends the
    process without unwinding. Only the main thread can set handlers; elsewhere it does nothing.
    The previous handlers are put back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


__all__ = ["check_remote", "exit_on_termination", "make_store_dir", "positive_int", "sweep_stale",
           "writable_dir", "STORE_PREFIX"]

