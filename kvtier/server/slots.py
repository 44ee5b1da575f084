"""Two-phase writes and held views on the host pool, for the server's zero-copy paths.

:class:`ReservableHostTier` is a :class:`~kvtier.tiers.host.HostTier` that lets
the server receive a block straight from the socket into its pool slot and send
it straight from the slot:

* ``reserve`` takes a slot for a key (evicting as ``put`` would) and returns a
  writable view; nothing is visible to readers yet. ``commit`` publishes the
  block, ``abort`` frees the slot (a torn or corrupt upload leaves no trace).
* ``hold`` pins a published block and returns a read-only view plus a release
  function; unlike ``borrow`` it is not a ``with`` block, so the pin can span
  the awaits of an asynchronous send. A held block is never evicted or reused;
  ``delete`` hides it at once and its slot is freed at the release.

NOTE: this is the API proposed for ``HostTier`` itself (``reserve/commit/abort``
and ``hold``, and huge pages for the pool); until it lands there it lives here,
on HostTier's internals.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier, _Entry


class Reservation(NamedTuple):
    key: BlockKey
    entry: _Entry
    view: np.ndarray  #: writable uint8 view of exactly the block's bytes


class Held(NamedTuple):
    view: np.ndarray  #: read-only uint8 view; valid until ``release()``
    release: Callable[[], None]


class ReservableHostTier(HostTier):
    def __init__(self, capacity_bytes: int, slot_bytes: int, **kw) -> None:
        prefault = kw.pop("prefault", True)
        super().__init__(capacity_bytes, slot_bytes, prefault=False, **kw)
        # Transparent huge pages before the first touch: the kernel copies every payload
        # into and out of this pool (socket recv/send), and with 4 KiB pages it walks and
        # misses the TLB 512 times as often -- the raw-socket baseline's numpy buffers get
        # huge pages from numpy itself.
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        if prefault:  # fault every page in now, as HostTier's MAP_POPULATE would
            flat = self._pool.reshape(-1)
            flat[:: mmap.PAGESIZE] = 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def reserve(
        self, key: BlockKey, nbytes: int, *, meta: BlockMeta | None = None
    ) -> tuple[Status, Reservation | None]:
        """(OK, reservation) to fill; (OK, None) if the key is held or being written; else (FULL | TOO_LARGE, None)."""
        if nbytes > self.slot_bytes or nbytes <= 0:
            with self._lock:
                self.stats.put_failures += 1
            return Status.TOO_LARGE, None
        with self._lock:
            if self._live(key) is not None or key in self._entries:
                self._policy.on_access(key)
                return Status.OK, None
            slot = self._reserve_slot_locked()
            if slot is None:
                self.stats.put_failures += 1
                return Status.FULL, None
            entry = _Entry(slot=slot, nbytes=nbytes, meta=meta, created=time.monotonic(), pins=1)
            self._entries[key] = entry
            self._used += self.slot_bytes
        return Status.OK, Reservation(key, entry, self._pool[slot, :nbytes])

    def commit(self, res: Reservation, *, parent: BlockKey | None = None) -> None:
        with self._lock:
            res.entry.published = True
            self._policy.on_insert(res.key, parent)
            self.stats.puts += 1
            self.stats.bytes_written += res.entry.nbytes
        self._unpin_entry(res.key, res.entry)

    def abort(self, res: Reservation) -> None:
        with self._lock:
            if self._entries.get(res.key) is res.entry:
                del self._entries[res.key]
            self.stats.put_failures += 1
            res.entry.doomed = True  # the last unpin (ours) frees the slot
        self._unpin_entry(res.key, res.entry)

    def hold(self, key: BlockKey) -> Held | None:
        with self._lock:
            entry = self._live(key)
            if entry is None:
                return None
            entry.pins += 1
            self._policy.on_access(key)
            self.stats.hits += 1
            self.stats.bytes_read += entry.nbytes
        view = self._pool[entry.slot, : entry.nbytes]
        view.flags.writeable = False
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._unpin_entry(key, entry)

        return Held(view, release)
