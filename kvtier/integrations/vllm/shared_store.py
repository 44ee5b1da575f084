"""One store per process for a configuration, shared by the scheduler- and worker-side connectors.

vLLM builds one connector per role. When both live in one process (the usual
single-GPU and CPU case) they must see the same host tier: the scheduler looks
up what the worker saved. Stores are reference counted and closed (pending
writes flushed) when the last role lets go. Roles in different processes each
get their own store; they then share only the disk and remote tiers.
"""

from __future__ import annotations

import dataclasses
import threading

from kvtier.core.layout import KVLayout
from kvtier.store.config import StoreConfig, build_store
from kvtier.store.tiered import TieredStore

_lock = threading.Lock()
_stores: dict[tuple[StoreConfig, KVLayout], list] = {}  # key -> [store, refcount]


def acquire(config: StoreConfig, layout: KVLayout) -> TieredStore:
    """The process's store for ``(config, layout)``, built on first use; pair with :func:`release`."""
    key = (config, dataclasses.replace(layout, tp_rank=0))  # slot sizes do not depend on the rank
    with _lock:
        entry = _stores.get(key)
        if entry is None:
            entry = _stores[key] = [build_store(config, layout), 0]
        entry[1] += 1
        return entry[0]


def release(store: TieredStore) -> None:
    """Drop one reference; the last one flushes and closes the store."""
    with _lock:
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
