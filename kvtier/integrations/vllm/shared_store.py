"""One store per process for a configuration, shared by the scheduler- and worker-side connectors.

vLLM builds one connector per role. When both live in one process (vLLM's
in-process executor) the scheduler uses the store of the worker of its engine
(:func:`worker_store`); otherwise it asks that worker over
:mod:`~kvtier.integrations.vllm.lookup_service`. Stores are reference counted
and closed (pending writes flushed) when the last user lets go.
"""

from __future__ import annotations

import dataclasses
import threading

from kvtier.core.layout import KVLayout
from kvtier.store.config import StoreConfig, build_store
from kvtier.store.tiered import TieredStore

_lock = threading.Lock()
_stores: dict[tuple[StoreConfig, KVLayout], list] = {}  # key -> [store, refcount]
_workers: dict[str, TieredStore] = {}  # engine id -> the store of its worker in this process


def acquire(config: StoreConfig, layout: KVLayout) -> TieredStore:
    """The process's store for ``(config, layout)``, built on first use; pair with :func:`release`."""
    key = (config, dataclasses.replace(layout, tp_rank=0))  # slot sizes do not depend on the rank
    with _lock:
        entry = _stores.get(key)
        if entry is None:
            entry = _stores[key] = [build_store(config, layout), 0]
        entry[1] += 1
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


def release(store: TieredStore) -> None:
    """Drop one reference; the last one flushes and closes the store."""
    with _lock:
        for engine_id, registered in list(_workers.items()):
            if registered is store:
                del _workers[engine_id]
        for key, entry in list(_stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _stores[key]
                break
        else:
            return
    store.flush()
    store.close()


def live_stores() -> int:
    with _lock:
        return len(_stores)
