"""The mechanism under :class:`~kvtier.tiers.mooncake.MooncakeTier`: one Mooncake client per
process, engine calls with a deadline, and the registered staging buffers they use.

* **Shared client.** ``MooncakeDistributedStore.setup`` starts a transfer engine (threads,
  a listening port, a registration with the metadata server); every tier of a process
  that names the same master shares one, reference counted.
* **Bounded calls.** The engine's calls block for as long as the engine likes (a frozen
  holder held a read 15 s; a dead master costs ~4 s a call). :meth:`BoundedCaller.call`
  runs the call on a worker thread and waits only until the caller's deadline. A call that
  overruns keeps running: whatever buffers it was given stay *its* own until it ends
  (``if_late`` gives them back then), so no late write ever lands in memory the caller
  got back.
* **Staging.** Reads land in page-aligned buffers registered with the engine once and then
  reused (the engine never writes into a caller's buffer: see the point above); a pool
  caps what it keeps registered.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

log = logging.getLogger(__name__)

# Mooncake's integer return codes (negative; see mooncake-store's types.h) that kvtier tells apart.
RC_NO_SPACE = -200
RC_BAD_PARAMS = -600  # for a get into a buffer: the object is larger than the buffer
RC_NOT_READY = -703  # another writer's put of the object has not completed
RC_NOT_FOUND = -704
RC_OBJECT_EXISTS = -705  # a put session's reservation of a name already stored
RC_HAS_LEASE = -706  # removal refused: a reader holds the object's lease
RC_TRANSFER_FAILED = -800  # a holder did not answer (dead, or gone since the master last heard)
RC_RPC_FAILED = -900  # the master did not answer

#: codes that mean the master (not one object) is unreachable: the tier backs off
MASTER_DOWN_CODES = frozenset({RC_RPC_FAILED})


class Overrun(Exception):
    """An engine call passed its deadline (it may still be running)."""


class Down(Exception):
    """The tier is backing off after a failure, or closed (internal to the tier: becomes a status)."""


class BoundedCaller:
    """Runs engine calls on worker threads; the caller waits at most until its deadline."""

    def __init__(self, workers: int = 16) -> None:
        # A stuck call holds its thread until the engine gives up on it; enough threads that a
        # few stuck calls do not queue the healthy ones behind them.
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-mooncake")
        self._running = 0  # calls submitted and not ended (overrun ones included)
        self._idle = threading.Condition()

    def _ended(self, _future) -> None:
        with self._idle:
            self._running -= 1
            if not self._running:
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every call submitted has ended, waiting at most ``timeout_s``."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._running, timeout=timeout_s)

    def call(self, deadline_in_s: float, fn: Callable, *args, if_late: Callable[[], None] | None = None):
        """``fn(*args)``; raises :class:`Overrun` after ``deadline_in_s`` seconds. ``if_late`` runs
        (on the worker) once an overrun call has really ended: the moment its buffers are free."""
        return self.wait(self.submit(fn, *args), deadline_in_s, if_late=if_late)

    def submit(self, fn: Callable, *args) -> Future:
        """Start ``fn(*args)`` (to overlap it with work of the caller's); :meth:`wait` for it.
        After :meth:`close`: :class:`Down` (a call racing the tier's close is a miss, not a crash)."""
        with self._idle:
            self._running += 1
        try:
            future = self._pool.submit(fn, *args)
        except RuntimeError:  # shut down: the tier closed under a call of one of its callers
            self._ended(None)
            raise Down("tier closed") from None
        except BaseException:
            self._ended(None)
            raise
        future.add_done_callback(self._ended)
        return future

    def wait(self, future: Future, deadline_in_s: float, *, if_late: Callable[[], None] | None = None):
        """The result of a :meth:`submit`-ted call, as :meth:`call` waits for it."""
        try:
            return future.result(timeout=max(0.0, deadline_in_s))
        except FutureTimeout:
            if if_late is not None:
                future.add_done_callback(lambda _f: if_late())
            raise Overrun(f"an engine call still running after {deadline_in_s:.2f} s") from None

    def close(self) -> None:
        # never wait for a stuck engine call: its thread ends when the engine gives up
        self._pool.shutdown(wait=False, cancel_futures=True)


class StagingPool:
    """Page-aligned buffers registered with one client, handed out and given back.

    Buffers are rounded up to a power of two pages (so a few sizes recur and are reused);
    at most ``keep_bytes`` are kept registered while idle, the rest unregistered and freed.
    """

    def __init__(self, client, keep_bytes: int = 256 << 20) -> None:
        self._client = client
        self._free: dict[int, list[tuple[mmap.mmap, np.ndarray]]] = {}
        self._kept = 0
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(nbytes: int) -> int:
        size = mmap.PAGESIZE
        while size < nbytes:
            size *= 2
        return size

    def take(self, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
        size = self._size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        region = mmap.mmap(-1, size)
        array = np.frombuffer(region, dtype=np.uint8)
        rc = self._client.register_buffer(array.ctypes.data, size)
        if rc != 0:  # unregistered still works over TCP (the engine copies), only slower
            log.debug("mooncake: register_buffer(%d bytes) returned %d", size, rc)
        return region, array

    def give(self, item: tuple[mmap.mmap, np.ndarray]) -> None:
        region, array = item
        size = array.nbytes
        with self._lock:
            if self._kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(item)
                self._kept += size
                return
        self._release(array)

    def _release(self, array: np.ndarray) -> None:
        try:
            self._client.unregister_buffer(array.ctypes.data)
        except Exception:  # noqa: BLE001 - a closed client: nothing left to unregister from
            pass
        # the mmap is unmapped when its last reference (the array's base) goes

    def clear(self) -> None:
        with self._lock:
            free, self._free, self._kept = self._free, {}, 0
        for items in free.values():
            for _, array in items:
                self._release(array)


class SharedClient:
    """One set-up ``MooncakeDistributedStore`` per (master, metadata server, hostname) in a process."""

    _registry: dict[tuple, "SharedClient"] = {}
    _registry_lock = threading.Lock()

    def __init__(self, key: tuple, store, transfer=None) -> None:
        self.key = key
        self.store = store
        #: the store's own transfer engine, for reading one chosen replica (None: not available)
        self.transfer = transfer
        self.refs = 0
        self.abandoned_calls = False  # a user let go while an engine call of its still ran
        self.staging = StagingPool(store)
        self._sessions: dict[str, int] = {}  # name → this process's reads in a get session of it
        self._ending: dict[str, threading.Event] = {}  # name → set once its session's end has run
        self._sessions_lock = threading.Lock()

    # A get session (the replicas of its names, asked once and cached by the client) is the
    # client's, per name: two reads of one name at once share it, and only the last one to finish
    # ends it (ending it under the other would fail that one's calls). Its end runs after the
    # last read has let go, outside the lock; a read of that name starting meanwhile waits for
    # the end to run before it starts a session, which the end would otherwise take with it.
    def sessions_opening(self, names, deadline: float | None = None) -> None:
        """Count a read in the sessions of ``names``, once no end of theirs is under way (waited
        for until ``deadline``, a ``time.monotonic`` time; past it the read goes on, at worst a
        miss)."""
        late = False
        while True:
            with self._sessions_lock:
                waits = [self._ending[name] for name in names if name in self._ending]
                if not waits or late:
                    for name in names:
                        self._sessions[name] = self._sessions.get(name, 0) + 1
                    return
            for ended in waits:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not ended.wait(left):
                    late = True
                    break

    def sessions_closing(self, names) -> list[str]:
        """The names no other read still uses: end their session, then call
        :meth:`sessions_ended` with them."""
        ending = []
        with self._sessions_lock:
            for name in names:
                left = self._sessions.get(name, 0) - 1
                if left > 0:
                    self._sessions[name] = left
                else:
                    self._sessions.pop(name, None)
                    if name not in self._ending:
                        self._ending[name] = threading.Event()
                    ending.append(name)
        return ending

    def sessions_ended(self, names) -> None:
        """The end of these names' sessions has run (or failed): reads of them may start theirs."""
        with self._sessions_lock:
            events = [self._ending.pop(name) for name in names if name in self._ending]
        for ended in events:
            ended.set()

    @classmethod
    def acquire(cls, master: str, metadata: str, hostname: str, *, local_buffer_bytes: int = 16 << 20,
                engine_tenant: str = "default", connect_timeout_s: float = 2.0) -> "SharedClient":
        key = (master, metadata, hostname, engine_tenant)
        with cls._registry_lock:
            shared = cls._registry.get(key)
            if shared is None:
                shared = cls(key, *_setup_client(master, metadata, hostname, local_buffer_bytes, engine_tenant,
                                                 connect_timeout_s))
                cls._registry[key] = shared
            shared.refs += 1
            return shared

    def release(self, *, calls_ended: bool = True) -> None:
        """One user less; the last one closes the client, unless a user's engine call was still
        running when it let go (``calls_ended`` False): closing the store under a running call
        crashed the process (a segmentation fault), so such a client is left to the process's end."""
        with self._registry_lock:
            self.refs -= 1
            self.abandoned_calls |= not calls_ended
            if self.refs > 0:
                return
            self._registry.pop(self.key, None)
        if self.abandoned_calls:
            log.warning("mooncake: an engine call still runs; the client is left open until the process ends")
            return
        self.staging.clear()
        try:
            self.store.close()
        except Exception as exc:  # noqa: BLE001 - closing must not fail a shutdown
            log.debug("mooncake: close failed: %s", exc)


def _probe_master(master: str, timeout_s: float) -> None:
    """Refuse a master nothing listens at, within ``timeout_s``. The engine's setup retries such
    a master for ~90 s holding the GIL (no thread of the process runs, no deadline can stop it)."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"the Mooncake master at {master} does not answer ({exc}): is mooncake_master "
                              f"running there?") from None


def _setup_client(master: str, metadata: str, hostname: str, local_buffer_bytes: int, engine_tenant: str,
                  connect_timeout_s: float = 2.0):
    """A pure client (contributes no memory: holders do) of the master at ``master``."""
    if hostname.startswith(("127.", "localhost")):
        # Otherwise the transfer engine advertises the first interface's address, which a
        # loopback-only cluster cannot reach.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError("the Mooncake tier needs mooncake-transfer-engine-non-cuda "
                          "(pip install 'kvtier[mooncake]'; apt-get install libibverbs1 ibverbs-providers)") from exc
    # The store runs on a transfer engine made here, so that a read can also be sent to one chosen
    # replica (the store's reads always try the first one, even when its holder is dead).
    transfer = None
    try:
        from mooncake.engine import TransferEngine

        transfer = TransferEngine()
        if transfer.initialize(hostname, metadata, "tcp", "") != 0:
            transfer = None
    except Exception as exc:  # noqa: BLE001 - an engine without it: reads fall back by retrying only
        log.debug("mooncake: no transfer engine of our own (%s)", exc)
        transfer = None
    _probe_master(master, connect_timeout_s)
    store = MooncakeDistributedStore()
    rc = store.setup(hostname, metadata, 0, local_buffer_bytes, "tcp", "", master,
                     transfer.get_engine() if transfer is not None else None, False, "", engine_tenant)
    if rc != 0:
        raise ConnectionError(f"Mooncake client setup failed (rc={rc}): is mooncake_master running at {master} "
                              f"with its metadata server at {metadata}?")
    return store, transfer
