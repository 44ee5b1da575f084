"""Children that do not outlive the process that started them.

A test run or a bench killed with SIGKILL cannot stop what it started: its servers and Mooncake
holders kept running (ppid 1) and skewed every benchmark after them. ``die_with_parent`` is
given to ``subprocess.Popen(preexec_fn=...)``: the kernel sends the child SIGTERM when its parent
goes (Linux ``PR_SET_PDEATHSIG``; elsewhere it does nothing).

The signal follows the *thread* that forked the child: start long-lived children from a thread
that lives as long as they should (the main thread, or a :class:`Spawner`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _resolve_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the caller's own stop() is all there is
        return None


# resolved here, in the parent: the child runs between fork and exec, where a dlopen could wait on
# a loader lock that another thread of the parent held at the fork
_prctl = _resolve_prctl()


# The pid of the process that forked last, recorded in it just before each fork (``subprocess`` runs
# the fork hooks when a ``preexec_fn`` is given); the child inherits the value.
_forker = 0


def _record_forker() -> None:
    global _forker
    _forker = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_record_forker)


def die_with_parent() -> None:
    """In the child, before exec: ask for SIGTERM when the parent dies.

    The request covers only a death after it is made: a child whose starter died between the
    fork and this call (it now has another parent, init or a subreaper) ends here instead of
    running on as the orphan this exists to prevent."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if _forker and os.getppid() != _forker:
            # Ended as the signal would have ended it; not by os.kill: a SIGTERM handler the
            # starter had set would run here, in the child, which would then exec.
            os._exit(128 + signal.SIGTERM)


class Spawner:
    """Starts children from one thread of its own, so that they die with this *process*.

    For code that starts children from short-lived threads (a transition thread, a request
    handler): a child forked there would get its SIGTERM as soon as that thread ended. The
    spawning thread lives until :meth:`close` (or interpreter exit, when the children should go
    too)."""

    def __init__(self, name: str = "kvtier-spawner") -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def popen(self, args, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(args, **kwargs)`` with ``die_with_parent``, forked on the spawner's thread."""
        if "preexec_fn" in kwargs:
            raise ValueError("Spawner sets preexec_fn itself")
        return self._pool.submit(subprocess.Popen, args, preexec_fn=die_with_parent, **kwargs).result()

    def close(self) -> None:
        """End the spawning thread: children still running get their SIGTERM now."""
        self._pool.shutdown(wait=True)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host is gone (never for this process itself): a writer's
    files named with its pid may then be removed at once."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        pass  # alive, another user's (or no pid at all: not ours to judge)
    return False


def host_tag() -> str:
    """8 hex digits naming this host and PID namespace: a pid means a process only within them (a
    cache directory shared by hosts or containers holds names of pids this process cannot see)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")   # "pid:[4026531836]": the same for all of this namespace
    except OSError:
        namespace = ""   # not Linux, or no /proc: the host's name alone
    return hashlib.blake2s(f"{socket.gethostname()}\0{namespace}".encode(), digest_size=4).hexdigest()


def owner_tag() -> str:
    """``{pid}-h{host_tag}``: what a directory's name carries to say that this process owns it,
    read back by :func:`owner_pid` (a name made with it still shows ``-{pid}-``)."""
    return f"{os.getpid()}-h{host_tag()}"


_OWNER = re.compile(r"-([0-9]+)(?:-h([0-9a-f]{8}))?\Z")


def owner_pid(stem: str) -> int | None:
    """The pid of the owner tag that ``stem`` ends with (after a ``-``), if that owner is of this host
    and PID namespace: ``…-{pid}-h{host_tag}`` with this host's tag, or ``…-{pid}`` alone (a name from
    before the tag, judged as before). None for another host's tag (its pid says nothing here) and
    for a stem without one."""
    match = _OWNER.search(stem)
    if match is None or (match.group(2) is not None and match.group(2) != host_tag()):
        return None
    return int(match.group(1))


def remove_dead_dirs(directory: str | os.PathLike, pid_of: Callable[[str], int | None]) -> list[Path]:
    """Remove the directories in ``directory`` whose name ``pid_of`` reads a pid from and whose
    process is gone (what a process killed before its clean-up left: a scratch store, an
    unfinished build); returns those removed. A name without a pid (``pid_of`` None) is left
    alone: nothing says its owner is gone. ``pid_of`` gives only pids of this host: a directory
    shared across hosts or containers holds others' live ones (:func:`owner_pid` reads names
    made with :func:`owner_tag` so)."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        pid = pid_of(entry.name)
        if pid is not None and process_gone(pid) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
