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
  caps what it keeps registered. Registering is an update of the metadata server, which
  has no deadline either: it runs on a thread of its own (:class:`Registrar`), and a buffer
  not registered in time is used as it is.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import socket
import threading
import time
import weakref
from collections import deque
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

    @property
    def running(self) -> int:
        """Calls submitted that have not ended (overrun ones included)."""
        return self._running

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


#: how long :meth:`Registrar.register` waits for a new buffer's registration (one update of the
#: metadata server, ~0.3 ms) before its caller uses the buffer unregistered
REGISTER_WAIT_S = 0.05


#: every registrar of the process, for :func:`_stop_registrars`
_registrars: weakref.WeakSet[Registrar] = weakref.WeakSet()


@atexit.register
def _stop_registrars() -> None:
    """At the process's end, let no registrar's thread (a daemon) be inside the engine: a daemon
    thread still in an engine call when the interpreter finalizes aborts the process ("terminate
    called without an active exception", exit 134). The engine's timeouts bound the wait."""
    for registrar in list(_registrars):
        registrar.stop()


class Registrar:
    """Registers and unregisters buffers with an engine (``register(array)``, ``unregister(array)``)
    on a daemon thread of its own, in the order asked, so that no caller waits for them.

    Each is an update of the metadata server (the master's HTTP server, as a rule): with that server
    frozen or cut off, 3 s to unregister and 6 s to register, paid on a reader's thread before its
    deadline even started (a get of 4 blocks against a 1 s deadline took 24 s). A buffer registered
    late, or never (-600 then), is still correct to use: over TCP the engine copies what is not
    registered, only a little slower. Every job holds its buffer, so an address is never reused
    while a registration of it is still asked."""

    def __init__(self, register: Callable[[np.ndarray], None], unregister: Callable[[np.ndarray], None]) -> None:
        _registrars.add(self)
        self._register_now, self._unregister_now = register, unregister
        self._jobs: deque[tuple[Callable, np.ndarray, threading.Event]] = deque()
        self._queued: dict[int, np.ndarray] = {}  # address → buffer whose registration has not started
        self._idle = threading.Condition()
        self._running_since: float | None = None  # when the job under way started (None: none)
        self._thread: threading.Thread | None = None
        self._closed = False

    def register(self, array: np.ndarray) -> None:
        """Ask for ``array`` to be registered, and wait for that at most :data:`REGISTER_WAIT_S` (not
        at all while the job under way takes longer: the server does not answer); past it the
        buffer is to be used as it is, registered later or never."""
        registered = self._ask(self._register, array, queued=True)
        if not self._behind():
            registered.wait(REGISTER_WAIT_S)

    def unregister(self, array: np.ndarray) -> None:
        """Ask for ``array`` to be unregistered; nothing is asked of the engine if its registration
        has not started yet (then neither runs, and the queue lets the buffer go at once)."""
        with self._idle:
            if self._queued.get(array.ctypes.data) is array:
                del self._queued[array.ctypes.data]
                self._drop_registration(array)
                return
        self._ask(self._unregister, array)

    def _drop_registration(self, array: np.ndarray) -> None:
        """Take ``array``'s registration job, not started, out of the queue (under ``_idle``). Left in
        it, the job kept the buffer alive until the thread reached it: with the metadata server not
        answering (3-6 s a job), memory grew by one given-back buffer per get (audit s32 a5 D3).

        Deleted by position: ``deque.remove`` compares the jobs ahead of it with ``==``, which for
        another registration's job compares the two buffers element by element and raises
        (ValueError) whenever two registrations are queued (audit s32 r6 D1)."""
        for n, (job, queued, done) in enumerate(self._jobs):
            if job == self._register and queued is array:
                del self._jobs[n]
                done.set()
                return

    def _behind(self) -> bool:
        """Whether the job under way has taken longer than a registration should (the metadata
        server does not answer): nobody should wait for the jobs queued behind it."""
        started = self._running_since
        return started is not None and time.monotonic() - started > REGISTER_WAIT_S

    def settle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every job asked so far to have run (False: some still wait).
        For callers that need the buffers registered before they go on (tests of the registered
        path on a loaded host, where a registration can come later than REGISTER_WAIT_S)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._jobs and self._running_since is None, timeout=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drop the jobs not started and wait for the one under way to end (the engine's own timeouts
        bound it: 6 s with the metadata server frozen; ``timeout_s`` only against an engine without)."""
        self.close(0.0)
        with self._idle:
            self._idle.wait_for(lambda: self._running_since is None, timeout=timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Run what was asked, waiting at most ``timeout_s``; then ask nothing more of the client
        (the thread ends). False: the jobs did not all end in time (the metadata server does not
        answer): those not started are dropped, and one may still be in the engine."""
        with self._idle:
            ran = self._idle.wait_for(lambda: not self._jobs and self._running_since is None, timeout=timeout_s)
            self._closed = True
            for _, _, done in self._jobs:
                done.set()
            self._jobs.clear()
            self._queued.clear()
            self._idle.notify_all()
        return ran

    def _ask(self, job: Callable, array: np.ndarray, *, queued: bool = False) -> threading.Event:
        done = threading.Event()
        with self._idle:
            if self._closed:  # (a late call's buffer given back after close: the client is closed or left)
                done.set()
                return done
            if queued:
                self._queued[array.ctypes.data] = array
            self._jobs.append((job, array, done))
            if self._thread is None:
                # a daemon, so that the process's exit waits for no job queued (nothing is lost with
                # them: a registration only speeds reads up); _stop_registrars waits for the one under way
                self._thread = threading.Thread(target=self._run, name="kvtier-mooncake-registrar", daemon=True)
                self._thread.start()
            self._idle.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._idle:
                self._idle.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job, array, done = self._jobs.popleft()
                self._running_since = time.monotonic()
            try:
                job(array)
            except Exception as exc:  # noqa: BLE001 - the binding raising: the buffer stays as it was
                log.debug("mooncake: a buffer's (un)registration failed: %s", exc)
            finally:
                with self._idle:
                    self._running_since = None
                    self._idle.notify_all()
                done.set()
            # the job's buffer is let go now: kept until the next job, the last buffer unregistered
            # (memory a closed tier registered) stayed alive for as long as no other job came
            del job, array, done

    def _register(self, array: np.ndarray) -> None:
        with self._idle:
            if self._queued.get(array.ctypes.data) is not array:
                return  # unregistered (given up) before its turn came
            del self._queued[array.ctypes.data]
        self._register_now(array)

    def _unregister(self, array: np.ndarray) -> None:
        self._unregister_now(array)
        # the mmap is unmapped when its last reference (the array's base) goes: this job's, at the latest


def _client_registrar(store) -> Registrar:
    """A registrar of staging buffers (and of memory a tier let go) with ``store``."""

    def register(array: np.ndarray) -> None:
        rc = store.register_buffer(array.ctypes.data, array.nbytes)
        if rc != 0:  # unregistered still works over TCP (the engine copies), only slower
            log.debug("mooncake: register_buffer(%d bytes) returned %d", array.nbytes, rc)

    return Registrar(register, lambda array: store.unregister_buffer(array.ctypes.data))


class StagingPool:
    """Page-aligned buffers registered with one client, handed out and given back.

    Buffers are rounded up to a power of two pages (so a few sizes recur and are reused);
    at most ``keep_bytes`` are kept registered while idle, the rest unregistered and freed.
    (Un)registration runs on the ``registrar``'s thread: :meth:`take` and :meth:`give` never wait
    for the metadata server past :data:`REGISTER_WAIT_S`.
    """

    def __init__(self, registrar: Registrar, keep_bytes: int = 256 << 20) -> None:
        self._registrar = registrar
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
        self._registrar.register(array)
        return region, array

    def give(self, item: tuple[mmap.mmap, np.ndarray]) -> None:
        region, array = item
        size = array.nbytes
        with self._lock:
            if self._kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(item)
                self._kept += size
                return
        self._registrar.unregister(array)

    def clear(self) -> None:
        """Let every kept buffer go (their unregistration asked of the registrar)."""
        with self._lock:
            free, self._free, self._kept = self._free, {}, 0
        for items in free.values():
            for _, array in items:
                self._registrar.unregister(array)


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
        #: for each user that let go while an engine call of its still ran: whether its late work
        #: has ended since (see :meth:`release`)
        self._late_users: list[Callable[[], bool]] = []
        #: (un)registers buffers off the callers' threads: the staging's, and those a tier let go
        self.registrar = _client_registrar(store)
        self.staging = StagingPool(self.registrar)
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
            shared._forget_ended_users()
            return shared

    def release(self, *, late_work_ended: Callable[[], bool] | None = None, timeout_s: float = 2.0) -> None:
        """One user less; the last one closes the client, unless an engine call a user left running
        when it let go still runs then (``late_work_ended``: given by such a user, says whether its
        calls have ended since): closing the store under a running call crashed the process (a
        segmentation fault), so such a client is left to the process's end. (Asked once, when the
        user let go, a call that ended long before the last user let go left the client open all the
        same: audit s32 a5 D5. Such users are asked again at every release and acquire, and let go
        of once their calls have ended: :meth:`_forget_ended_users`.) So is one whose buffers'
        unregistration did not end within ``timeout_s``: its metadata server does not answer (each
        took 3 s, one after the other, a close 3 s per staging buffer kept; and the store's own
        close, holding the GIL, took 9 s with buffers still registered)."""
        with self._registry_lock:
            self.refs -= 1
            if late_work_ended is not None:
                self._late_users.append(late_work_ended)
            self._forget_ended_users()
            if self.refs > 0:
                return
            self._registry.pop(self.key, None)
        if self._late_users:
            log.warning("mooncake: an engine call still runs; the client is left open until the process ends")
            return
        self.staging.clear()
        if not self.registrar.close(timeout_s):
            log.warning("mooncake: the metadata server did not answer within %.1f s; the client is left open "
                        "until the process ends", timeout_s)
            return
        try:
            self.store.close()
        except Exception as exc:  # noqa: BLE001 - closing must not fail a shutdown
            log.debug("mooncake: close failed: %s", exc)
        self._let_transfer_go()

    def _forget_ended_users(self) -> None:
        """Let go of the users whose late work has ended (under the registry lock); asking each one
        says so and has it let go of the memory it registered. Kept until the last user let go,
        every tier that closed with a call running stayed referenced, its registered memory (a KV
        pool, a host pool) alive and registered, one more per such close (audit s33 a3 D3)."""
        self._late_users = [ended for ended in self._late_users if not ended()]

    def _let_transfer_go(self) -> None:
        """Tear the client's own transfer engine down now, on the closing thread. Its binding has no
        close: its destructor holds the GIL ~1 s (every thread of the process stalls). Left to the
        garbage collector (a closed tier sits in reference cycles), that second landed at whatever
        moment a later collection ran: inside another tier's engine call, which then overran its
        deadline and took that tier down. Tiers reach it only through :attr:`transfer`, so this drops
        the last reference."""
        self.transfer = None


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
