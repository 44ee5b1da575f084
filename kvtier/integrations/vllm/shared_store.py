"""One store per process for a configuration, shared by the scheduler- and worker-side connectors.

vLLM builds one connector per role. When both live in one process (vLLM's
in-process executor) the scheduler uses the store of the worker of its engine
(:func:`worker_store`); otherwise it asks that worker over
:mod:`~kvtier.integrations.vllm.lookup_service`. Stores are reference counted
and closed when the last user lets go.

**Shutdown.** Closing a store flushes the host blocks not yet in a lower tier
(write-back keeps them only in DRAM until evicted), bounded by the connector's
``shutdown_flush_s``, and logs what was flushed and dropped. vLLM asks for it
through ``KvtierConnector.shutdown`` on every path we know of: the engine
core's shutdown (``LLM`` deleted or collected, interpreter exit through its
finalizer, ``vllm serve`` SIGTERM/SIGINT, which vLLM turns into ``SystemExit``
in the engine-core and worker processes). Two fallbacks cover the rest:

* an ``atexit`` hook closes every store still open at interpreter exit
  (a process that exits without shutting its engine down);
* where SIGTERM still has its default action (it would kill the process
  without running ``atexit``) and the store is built on the main thread — an
  ``LLM`` in a plain script — SIGTERM raises ``SystemExit`` instead, so that
  the process unwinds through the two paths above. A handler someone else
  installed (vLLM's own, an application's) is left alone; a second SIGTERM
  kills at once.

A SIGTERM that arrives while a store is closing (the engine's shutdown at the
end of a script, the ``atexit`` hook itself) waits for that close: its flush is
bounded already, and cutting it short loses what only DRAM held. The process
then exits with status 143, as for a SIGTERM at any other time, except during
the ``atexit`` hook, where the process is exiting already and keeps its status.
A close that fails or is interrupted by another exception (``KeyboardInterrupt``,
another handler's ``SystemExit``) does not keep the other stores from closing.

SIGKILL and power loss lose what only DRAM held: that is what write-behind
(the store copying dirty blocks down in the background) bounds.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import signal
import threading
import time

from kvtier.core.layout import KVLayout
from kvtier.store.config import StoreConfig, build_store
from kvtier.store.tiered import TieredStore

log = logging.getLogger(__name__)

#: seconds a close may spend flushing when the caller gives no bound
DEFAULT_FLUSH_TIMEOUT_S = 4.0

_lock = threading.Lock()
_stores: dict[tuple[StoreConfig, KVLayout], list] = {}  # key -> [store, refcount, flush timeout]
_workers: dict[str, TieredStore] = {}  # engine id -> the store of its worker in this process
_exit_hooks_installed = False

#: seconds a close may take beyond its flush bound (puts under way, closing the tiers) before a
#: SIGTERM stops waiting for it on another thread
CLOSE_GRACE_S = 5.0
#: thread id -> when the SIGTERM handler stops waiting for the closes under way on it. Written by
#: each thread for its own id only and read by the handler without ``_lock`` (which the main
#: thread may hold when the signal interrupts it): one dict operation at a time under the GIL.
_closing: dict[int, float] = {}
_deferred_exit: int | None = None   # status of a SIGTERM that came during the main thread's close


def acquire(config: StoreConfig, layout: KVLayout, *, flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> TieredStore:
    """The process's store for ``(config, layout)``, built on first use; pair with :func:`release`.

    ``flush_timeout_s`` bounds the flush when the store is closed by the
    exit fallbacks (the largest asked for wins).
    """
    key = (config, dataclasses.replace(layout, tp_rank=0))  # slot sizes do not depend on the rank
    with _lock:
        entry = _stores.get(key)
        if entry is None:
            entry = _stores[key] = [build_store(config, layout), 0, flush_timeout_s]
        entry[1] += 1
        entry[2] = max(entry[2], flush_timeout_s)
        _install_exit_hooks()
        return entry[0]


def register_worker(engine_id: str, store: TieredStore) -> None:
    with _lock:
        _workers[engine_id] = store


def worker_store(engine_id: str) -> TieredStore | None:
    """The store of this engine's worker if it runs in this process (one more reference), else None."""
    with _lock:
        store = _workers.get(engine_id)
        if store is None:
            return None
        for entry in _stores.values():
            if entry[0] is store:
                entry[1] += 1
                return store
        return None


def release(store: TieredStore, *, flush_timeout_s: float | None = None):
    """Drop one reference; the last one closes the store, flushing for at most
    ``flush_timeout_s`` (default: the bound given at :func:`acquire`).

    Returns the store's flush report when this call closed it, else None.
    """
    # Marked closing before the store leaves the registry: a SIGTERM from here on waits for the
    # close (a release that closes nothing is over at once).
    with _closing_on_this_thread():
        with _lock:
            for engine_id, registered in list(_workers.items()):
                if registered is store:
                    del _workers[engine_id]
            for key, entry in list(_stores.items()):
                if entry[0] is store:
                    entry[1] -= 1
                    if entry[1] > 0:
                        return None
                    del _stores[key]
                    timeout = entry[2] if flush_timeout_s is None else flush_timeout_s
                    _closing[threading.get_ident()] += timeout
                    break
            else:
                return None  # closed already (by the exit hook, or a double release)
        return close_store(store, timeout, why="engine shutdown")


def close_all(*, why: str = "interpreter exit") -> list:
    """Close every store still open (the ``atexit`` fallback); returns their flush reports (None
    for a store whose close failed). Each store is closed even if closing another raised; the
    first exception that is no ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) is raised
    once all are closed."""
    return _close_all(why=why)


def _close_all(*, why: str, exit_after: bool = True) -> list:
    reports, interrupted = [], None
    with _closing_on_this_thread(exit_after=exit_after):
        with _lock:
            entries = list(_stores.values())
            _stores.clear()
            _workers.clear()
            _closing[threading.get_ident()] += sum(timeout for _, _, timeout in entries)
        for store, _, timeout in entries:
            try:
                reports.append(close_store(store, timeout, why=why))
            except BaseException as exc:  # noqa: BLE001 - the other stores still close
                log.warning("kvtier: closing a store at %s was interrupted (%s); its unflushed blocks are lost",
                            why, exc.__class__.__name__)
                reports.append(None)
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    return reports


def _close_at_exit() -> None:
    """The ``atexit`` hook: the process is exiting already, so a SIGTERM during its flush only
    waits for it (the exit status stays the process's own)."""
    _close_all(why="interpreter exit", exit_after=False)


def close_store(store: TieredStore, flush_timeout_s: float, *, why: str):
    """Wait for the store's queued writes, flush what only its host tier holds
    (bounded), close it, and log the outcome. Never raises: the engine is
    going away and a failed flush is a future miss."""
    try:
        report = store.close(flush_timeout_s=flush_timeout_s)
    except Exception as exc:  # noqa: BLE001 - shutting down: report, never fail the exit
        log.warning("kvtier: closing the store at %s failed (%s); unflushed blocks are lost", why, exc)
        return None
    flushed, dropped = getattr(report, "flushed", 0), getattr(report, "dropped", 0)
    log.log(logging.WARNING if dropped else logging.INFO,
            "kvtier: store closed at %s: %d host blocks flushed to %s, %d dropped (%.2fs of a %.1fs bound)",
            why, flushed, [t.name for t in store.tiers[1:]] or "no lower tier", dropped,
            getattr(report, "seconds", 0.0), flush_timeout_s)
    return report


def live_stores() -> int:
    with _lock:
        return len(_stores)


# -- exit fallbacks -----------------------------------------------------------------
def _install_exit_hooks() -> None:
    """Once per process (under ``_lock``): the atexit hook, and SIGTERM → SystemExit where SIGTERM
    would otherwise kill the process without running it."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    atexit.register(_close_at_exit)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


@contextlib.contextmanager
def _closing_on_this_thread(*, exit_after: bool = True):
    """Closes under way on this thread (the caller adds their flush bounds to ``_closing[me]``
    once known; ``CLOSE_GRACE_S`` each bracket). When the outermost ends on the main thread and
    a SIGTERM came meanwhile, the process exits (``SystemExit``) unless ``exit_after`` is false
    or an exception is on its way out already."""
    global _deferred_exit
    me = threading.get_ident()
    outer = me in _closing
    _closing[me] = _closing.get(me, time.monotonic()) + CLOSE_GRACE_S
    try:
        yield
    finally:
        if not outer:
            del _closing[me]
    on_main = threading.current_thread() is threading.main_thread()
    if not outer and exit_after and _deferred_exit is not None and on_main:
        status, _deferred_exit = _deferred_exit, None
        log.info("kvtier: the store is closed; exiting for the SIGTERM that came during its flush")
        raise SystemExit(status)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM → ``SystemExit`` (on the main thread, where Python runs handlers); while a store
    closes, only once the close has ended. Takes no lock: the main thread may hold one."""
    global _deferred_exit
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM is not negotiable
    if threading.get_ident() in _closing:
        # Raised here, the SystemExit would abandon the close's flush in the middle (the store
        # already out of the registry, so no atexit flush either): the close raises it after.
        log.warning("kvtier: SIGTERM during the store's bounded flush; exiting once it ends "
                    "(a second SIGTERM kills at once)")
        _deferred_exit = 128 + signum
        return
    closing = list(_closing.values())
    if closing:   # a close under way on another thread: the exit would kill a daemon flusher under it
        log.warning("kvtier: SIGTERM while a store closes on another thread; exiting once it ends "
                    "(a second SIGTERM kills at once)")
        deadline = max(closing)
        while _closing and time.monotonic() < deadline:
            time.sleep(0.02)
    log.info("kvtier: SIGTERM; exiting through atexit so that the store is flushed")
    raise SystemExit(128 + signum)
