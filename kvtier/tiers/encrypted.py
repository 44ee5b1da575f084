"""``EncryptedTier``: seals blocks for one tenant before they reach the tier below.

Wraps any tier (disk, remote, host). ``put`` seals the block (chunked AES-256-GCM,
:mod:`kvtier.crypto.aead`) into a reusable page-aligned staging buffer and stores
the sealed bytes under the tenant's keyed storage name (HMAC of the block key);
``get`` fetches the sealed bytes and opens them into the caller's buffer. A
block that fails authentication under a key we hold -- tampered, moved to
another key or tenant -- is :attr:`Status.CORRUPT`: counted in
``verify_failures``, logged, never returned, and deleted from the tier below
(it can never verify). A block sealed under a key this process cannot find --
another process rotated and wrote with the new key, or the epoch was retired
or shredded -- is a :attr:`Status.MISS` and is *kept*: the keyring re-reads
its store once (rate limited, :meth:`Keyring.key_for_read`) before giving up,
and a reader that has the key still opens it. Nothing else (a malformed or
wrong-size block) deletes either: only a failed tag under a key we hold proves
a block bad.

Over a remote tier this is end-to-end encryption: the server only ever stores
ciphertext under names it cannot link to prompts.

Over a :class:`~kvtier.tiers.streams.StreamingTier` (a kvtier server, a disk
tier) blocks are not staged whole: each chunk is sealed into one small buffer
and sent (or staged for the file) at once, and each arriving chunk is opened at
once, while it is in cache; over a server the AEAD tags stand in for its
checksum. A batch is split over ``streams`` lanes, block *i* in lane *i* mod
``streams``, each sealing and moving its blocks on its own connection (or file)
and thread: sealing then runs beside the I/O instead of after it.

Not supported: demotion *out of* an encrypted tier (the store would need the
plaintext and the client key back); blocks it evicts are dropped. ``keys()``
lists nothing: storage names are one-way by design.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from kvtier.core.framing import frame_str
from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.crypto import aead
from kvtier.crypto.keyring import Keyring
from kvtier.tiers.base import Status, Tier, runs_by_bytes, writable_bytes
from kvtier.tiers.streams import StreamingTier, Unverifiable
from kvtier.tiers.wrapper import WrappingTier

log = logging.getLogger(__name__)


class _Staging(threading.local):
    """One page-aligned buffer per thread, grown as needed and then reused."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None

    def get(self, nbytes: int) -> np.ndarray:
        if self.buf is None or self.buf.nbytes < nbytes:
            size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            self.buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        return self.buf[:nbytes]


class _BufferPool:
    """Page-aligned buffers handed out and given back, so batch pipelines never allocate.

    With a ``registrar`` (an inner tier that receives reads straight into memory registered with
    it, :meth:`~kvtier.tiers.mooncake.MooncakeTier.register_memory`), each buffer is registered
    once, when made, and unregistered when the pool lets it go. A read that overran its deadline
    may still write into such a buffer: the caller then :meth:`quarantine`-s it instead of giving
    it back, and it is handed out again only once the registrar has no late read left
    (``late_direct_reads == 0``), so a late write never lands in a block read after it."""

    KEEP = 4

    def __init__(self, registrar=None) -> None:
        self._free: list[np.ndarray] = []
        self._quarantined: list[np.ndarray] = []
        self._registrar = registrar
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            released: list[np.ndarray] = []
            if self._quarantined and self._registrar.late_direct_reads == 0:
                released, self._quarantined = self._quarantined, []
        for buf in released:
            self.give(buf)
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        if self._registrar is not None:
            try:
                self._registrar.register_memory(buf)
            except RuntimeError as exc:  # still correct unregistered: the tier reads it through staging
                log.warning("encrypted tier: staging not registered with %s (%s): reads copy", self._registrar, exc)
        return buf

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.KEEP:
                self._free.append(buf)
                return
        if self._registrar is not None:
            self._registrar.unregister_memory(buf)

    def quarantine(self, buf: np.ndarray) -> None:
        """``buf`` may still be written by a late read: keep it out of use until none is left."""
        with self._lock:
            self._quarantined.append(buf)


#: Sealed bytes fetched per inner ``get_many`` in a batch: large enough that a tier moving a
#: batch's blocks at once keeps two or more 32 MiB blocks in flight, small enough that the two
#: groups held (one arriving, one being opened) stay a bounded staging cost.
GROUP_BYTES = 64 << 20


def _page_up(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class EncryptedTier(WrappingTier):
    def __init__(
        self,
        inner: Tier,
        keyring: Keyring,
        tenant: str | None = None,
        *,
        tenant_of: Callable[[BlockKey], str | None] | None = None,
        chunk_bytes: int | None = None,
        threads: int = 2,
        streams: int = 2,
    ) -> None:
        """Seal for one ``tenant``, or, on a server that holds many tenants' blocks in one
        tier, for the tenant ``tenant_of(key)`` names (None: the block is refused).
        ``threads`` seal the chunks of one staged block in parallel; ``streams`` lanes
        move a batch over a streaming tier. ``chunk_bytes`` defaults to what suits the
        inner tier (:data:`~kvtier.crypto.aead.STREAM_CHUNK_BYTES` for a streaming one);
        readers must use the writers' size."""
        super().__init__(inner)
        if (tenant is None) == (tenant_of is None):
            raise ValueError("give exactly one of tenant= and tenant_of=")
        self.name = f"encrypted({inner.name})"
        self.keyring = keyring
        self.tenant = tenant
        self._tenant_of = tenant_of
        if chunk_bytes is None:
            streaming = isinstance(inner, StreamingTier)
            chunk_bytes = aead.STREAM_CHUNK_BYTES if streaming else aead.DEFAULT_CHUNK_BYTES
        self.chunk_bytes = chunk_bytes
        self._staging = _Staging()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-aead") if threads > 1 else None
        # Batches overlap sealing (opening) of one block with the inner tier's I/O of
        # another: AES-GCM and socket/file I/O both release the GIL.
        self._pipe = ThreadPoolExecutor(1, thread_name_prefix="kvtier-aead-pipe")
        # Over a tier that receives reads straight into memory registered with it (Mooncake) and
        # lets a caller whose payloads authenticate themselves skip its payload hash, the batch
        # staging is registered with it: a sealed block lands where it is opened (no copy out of
        # the tier's own staging) and is checked once, by its AES-GCM tags (see get_many).
        self._direct = (callable(getattr(inner, "register_memory", None)) and hasattr(inner, "direct_overruns")
                        and getattr(inner, "reads_unhashed", False))
        self._buffers = _BufferPool(inner if self._direct else None)
        self.streams = max(1, streams)
        self._lanes = (ThreadPoolExecutor(self.streams - 1, thread_name_prefix="kvtier-aead-lane")
                       if self.streams > 1 else None)
        self._scratch = _BufferPool()  # one chunk-sized buffer per lane

    @property
    def on_evict(self):
        return None

    @on_evict.setter
    def on_evict(self, _hook) -> None:
        pass  # see module docstring: no demotion out of an encrypted tier

    def _owner(self, key: BlockKey) -> str | None:
        return self.tenant if self._tenant_of is None else self._tenant_of(key)

    @staticmethod
    def _context(tenant: str) -> bytes:
        return frame_str(1, "tenant") + frame_str(2, tenant)

    def storage_name(self, key: BlockKey) -> BlockKey:
        """The keyed name a block is stored under in the inner tier."""
        owner = self._owner(key)
        if owner is None:
            # No tenant, no key: a name nobody can have written, so every lookup misses.
            return BlockKey(b"\0" * 32)
        return BlockKey(self.keyring.storage_key(owner, key))

    _name = storage_name

    def _lookup_for(self, tenant: str) -> "_KeyLookup":
        return _KeyLookup(self.keyring, tenant)

    # -- contract ---------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.inner.contains(self._name(key))

    def lookup_prefix(self, keys) -> int:
        return self.inner.lookup_prefix([self._name(k) for k in keys])

    def _seal(self, tenant: str, name: BlockKey, data, out: np.ndarray, executor) -> np.ndarray:
        """Seal ``data`` into ``out`` for ``tenant``; returns the view of the sealed bytes."""
        plain = memoryview(data).cast("B")
        # reserved before sealing: the store's budget for the key must cover every chunk we seal
        data_key = self.keyring.key_for_write(tenant, aead.n_chunks(plain.nbytes, self.chunk_bytes))
        n = aead.seal_into(
            data_key.aead,
            epoch=data_key.epoch,
            key_id=data_key.key_id,
            storage_key=name,
            context=self._context(tenant),
            plain=plain,
            out=out,
            chunk_bytes=self.chunk_bytes,
            executor=executor,
        )
        return out[:n]

    def _open(self, tenant: str, name: BlockKey, sealed: np.ndarray, out, executor) -> Status:
        lookup = self._lookup_for(tenant)
        why = aead.open_into(lookup, storage_key=name, context=self._context(tenant), sealed=sealed, out=out,
                             executor=executor)
        if why is None:
            return Status.OK
        if lookup.found:
            # AES-GCM decrypts before it checks a tag: a block moved here from another name of ours
            # left that block's plaintext in ``out``. Wiped, so that a caller who ignores the status
            # still never reads another block's bytes.
            np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8).fill(0)
        status = Status.MISS if lookup.missing else Status.CORRUPT
        with self._lock:  # (the tier below counted a hit: it returned the sealed bytes)
            if status is Status.MISS:
                self.inner.stats.misses += 1
            else:
                self.inner.stats.verify_failures += 1
        self._reject(tenant, name, why, lookup)
        return status

    def _reject(self, tenant: str, name: BlockKey, why: str, lookup: "_KeyLookup") -> None:
        """Log a block that did not open; delete it only if it failed authentication under a key we
        hold (tampered: it will never verify). A missing key proves nothing about the block."""
        if lookup.missing:
            log.info("encrypted block %s… of tenant %r kept unread: %s (not in this key store)",
                     name.hex()[:16], tenant, why)
            return
        log.warning("encrypted block %s… of tenant %r rejected: %s", name.hex()[:16], tenant, why)
        if lookup.found:  # the tag failed under our key: it will never verify, free the space
            remove = getattr(self.inner, "remove_unverifiable", None) if self._direct else None
            if remove is not None:  # (read unhashed below: the tags were the check, remove by force)
                remove(name)
            else:
                self.inner.delete(name)

    def _sealed_size(self, plain_nbytes: int) -> int:
        return aead.sealed_nbytes(plain_nbytes, self.chunk_bytes)

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None) -> Status:
        owner = self._owner(key)
        if owner is None:
            return Status.ERROR
        name = self._name(key)
        if self.inner.contains(name):
            return Status.OK
        if self._streaming():
            return self._put_lane([(owner, name, data, self._name(parent) if parent else None)])[0]
        nbytes = memoryview(data).nbytes
        sealed = self._seal(owner, name, data, self._staging.get(self._sealed_size(nbytes)), self._pool)
        # meta stays out: dtype and shape are not secret-free (they reveal the model).
        return self.inner.put(name, sealed, parent=self._name(parent) if parent else None)

    def get(self, key: BlockKey, out) -> Status:
        dst = writable_bytes(out)
        name = self._name(key)
        owner = self._owner(key)
        if owner is None:
            return Status.MISS
        if self._streaming():
            return self._get_lane([(owner, name, dst)])[0]
        staging = self._staging.get(self._sealed_size(dst.nbytes))
        status = self.inner.get(name, staging)
        if status is not Status.OK:
            return status
        return self._open(owner, name, staging, dst, self._pool)

    def put_many(self, keys, datas, *, parents=None, metas=None) -> list[Status]:
        """Seal group g+1 while the inner tier stores group g (double buffered; groups as in
        :meth:`get_many`, stored with one ``inner.put_many`` each)."""
        if len(keys) != len(datas):
            raise ValueError(f"put_many: {len(keys)} keys but {len(datas)} buffers")
        if self._streaming():
            return self._put_streamed(keys, datas, parents)
        if self._tenant_of is not None:  # one tenant per key: the plain per-key path
            return super().put_many(keys, datas, parents=parents, metas=metas)
        if parents is None:
            parents = [None, *keys[:-1]]
        names = [self._name(k) for k in keys]
        present = self.inner.contains_many(names)
        todo = [i for i in range(len(keys)) if not present[i]]
        statuses = [Status.OK] * len(keys)
        sizes = {i: self._sealed_size(memoryview(datas[i]).nbytes) for i in todo}
        groups = list(runs_by_bytes(todo, [_page_up(sizes[i]) for i in todo], GROUP_BYTES))
        held: list[np.ndarray] = []  # one staging buffer per group in flight (at most two)
        job = None  # future sealing the next group

        def seal(group: list[int], buf: np.ndarray) -> list[np.ndarray]:
            views, at = [], 0
            for i in group:
                views.append(self._seal(self.tenant, names[i], datas[i], buf[at:at + sizes[i]], None))
                at += _page_up(sizes[i])
            return views

        def start(g: int):
            buf = self._buffers.take(sum(_page_up(sizes[i]) for i in groups[g]))
            held.append(buf)
            return self._pipe.submit(seal, groups[g], buf)

        try:
            job = start(0) if groups else None
            for g, group in enumerate(groups):
                sealed = job.result()
                job = start(g + 1) if g + 1 < len(groups) else None
                group_parents = [self._name(parents[i]) if parents[i] else None for i in group]
                stored = self.inner.put_many([names[i] for i in group], sealed, parents=group_parents)
                for i, status in zip(group, stored):
                    statuses[i] = status
                self._release(held[:1])  # this group's buffer; the next one's is being sealed
                del held[:1]
        finally:
            if job is not None:  # (an error above) the sealing still writes a held buffer
                wait([job])
            self._release(held)
        return statuses

    def get_many(self, keys, outs) -> list[Status]:
        """Open group g while the inner tier fetches group g+1 (double buffered).

        A group is a run of blocks of up to :data:`GROUP_BYTES` sealed bytes (at least one
        block), fetched with one ``inner.get_many``: a tier that moves a batch's blocks at once
        (Mooncake's sessions, the disk tier's pipelined reads) keeps that concurrency under
        the seal instead of being asked block by block."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        if self._streaming():
            return self._get_streamed(keys, outs)
        if self._tenant_of is not None:
            return super().get_many(keys, outs)
        dsts = [writable_bytes(o) for o in outs]
        sizes = [self._sealed_size(d.nbytes) for d in dsts]
        statuses: list[Status] = [Status.MISS] * len(keys)
        job = None  # future opening the group fetched last
        held: list[np.ndarray] = []  # one staging buffer per group in flight (at most two)
        tainted: set[int] = set()  # ids of held buffers a late read may still write into
        try:
            groups = list(runs_by_bytes(range(len(sizes)), [_page_up(n) for n in sizes], GROUP_BYTES))
            for g, group in enumerate(groups):
                names = [self._name(keys[i]) for i in group]
                # one page-aligned buffer per group, each block at a page boundary in it
                buf = self._buffers.take(sum(_page_up(sizes[i]) for i in group))
                held.append(buf)
                views, at = [], 0
                for i in group:
                    views.append(buf[at:at + sizes[i]])
                    at += _page_up(sizes[i])
                fetched = self._fetch(names, views, buf, tainted)
                if job is not None:  # the previous group, opened while this one arrived
                    job.result()
                    job = None
                self._release(held[:-1], tainted)
                del held[:-1]
                ready = []
                for i, name, view, status in zip(group, names, views, fetched):
                    if status is Status.OK:
                        ready.append((i, name, view))
                    else:
                        statuses[i] = status
                if ready and g + 1 < len(groups):
                    job = self._pipe.submit(self._open_group, ready, dsts, statuses, None)
                elif ready:  # the last group: nothing left to overlap, open its chunks on every AEAD thread
                    self._open_group(ready, dsts, statuses, self._pool)
            if job is not None:
                job.result()
                job = None
        finally:
            if job is not None:  # (an error above) the opening still reads a held buffer
                wait([job])
            self._release(held, tainted)
        return statuses

    def _fetch(self, names, views, buf: np.ndarray, tainted: set[int]) -> list[Status]:
        """One group's inner ``get_many`` into ``buf``.

        Into registered staging (``self._direct``), the inner tier does not hash the payloads:
        each object's header must still name the block at its size, and the AES-GCM tags then
        authenticate every byte, bound to the tenant, the block's keyed name and its size (the
        sealed header, in every chunk's AAD). A read of this group that overran its deadline
        may still land in ``buf`` later (in the slice of a block that is a miss: a block read whole
        is in a slice of its own): ``buf`` is then marked in ``tainted`` and, once released,
        quarantined instead of reused."""
        if not self._direct:
            return self.inner.get_many(names, views)
        overruns = self.inner.direct_overruns
        fetched = self.inner.get_many(names, views, hash_payloads=False)
        if self.inner.direct_overruns != overruns:  # (perhaps another thread's: quarantined anyway)
            tainted.add(id(buf))
        return fetched

    def _open_group(self, ready, dsts, statuses, executor) -> None:
        for i, name, view in ready:
            statuses[i] = self._open(self.tenant, name, view, dsts[i], executor)

    def _release(self, bufs, tainted: set[int] = frozenset()) -> None:
        for b in bufs:
            if id(b) in tainted:
                self._buffers.quarantine(b)
            else:
                self._buffers.give(b)

    # -- streamed: sealed and opened chunk by chunk as a streaming tier moves them ------------
    def _streaming(self) -> bool:
        return isinstance(self.inner, StreamingTier) and self.inner.streams_available()

    def _put_streamed(self, keys, datas, parents) -> list[Status]:
        if parents is None:
            parents = [None, *keys[:-1]]
        owners = [self._owner(k) for k in keys]
        names = [self._name(k) for k in keys]
        statuses = [Status.OK if o is not None else Status.ERROR for o in owners]
        present = self.inner.contains_many(names)
        todo = [i for i in range(len(keys)) if owners[i] is not None and not present[i]]
        items = [(owners[i], names[i], datas[i], self._name(parents[i]) if parents[i] else None) for i in todo]
        for i, status in zip(todo, self._in_lanes(self._put_lane, items)):
            statuses[i] = status
        return statuses

    def _get_streamed(self, keys, outs) -> list[Status]:
        owners = [self._owner(k) for k in keys]
        statuses = [Status.MISS] * len(keys)
        todo = [i for i in range(len(keys)) if owners[i] is not None]
        items = [(owners[i], self._name(keys[i]), writable_bytes(outs[i])) for i in todo]
        for i, status in zip(todo, self._in_lanes(self._get_lane, items)):
            statuses[i] = status
        return statuses

    def _in_lanes(self, work, items: list) -> list[Status]:
        """``work`` over ``items`` in up to ``streams`` lanes (item i in lane i mod lanes, so blocks
        still go out about in order); the caller's thread runs lane 0. Statuses in item order."""
        lanes = min(self.streams, len(items))
        if lanes <= 1:
            return work(items) if items else []
        others = [self._lanes.submit(work, items[j::lanes]) for j in range(1, lanes)]
        parts = [work(items[0::lanes])] + [f.result() for f in others]
        out: list[Status] = [Status.ERROR] * len(items)
        for j, part in enumerate(parts):
            out[j::lanes] = part
        return out

    def _put_lane(self, items) -> list[Status]:
        """Seal and store ``(owner, name, data, parent name)`` items in order through one buffer."""
        scratch = self._scratch.take(aead.stream_buffer_nbytes(self.chunk_bytes))
        try:
            sources = []
            for owner, name, data, _ in items:
                data_key = self.keyring.key_for_write(owner, aead.n_chunks(memoryview(data).nbytes, self.chunk_bytes))
                source = aead.SealingSource(
                    data_key.aead, epoch=data_key.epoch, key_id=data_key.key_id, storage_key=name,
                    context=self._context(owner), plain=data, scratch=scratch, chunk_bytes=self.chunk_bytes,
                )
                sources.append(source)
            return self.inner.put_streams([it[1] for it in items], sources, parents=[it[3] for it in items])
        finally:
            self._scratch.give(scratch)

    def _get_lane(self, items) -> list[Status]:
        """Fetch and open ``(owner, name, out)`` items in order through one buffer."""
        scratch = self._scratch.take(aead.stream_buffer_nbytes(self.chunk_bytes))
        try:
            sinks = [
                _OpeningSink(self._lookup_for(owner), storage_key=name, context=self._context(owner), out=out,
                             scratch=scratch, chunk_bytes=self.chunk_bytes)
                for owner, name, out in items
            ]
            statuses = self.inner.get_streams([it[1] for it in items], sinks)
        finally:
            self._scratch.give(scratch)
        for (owner, name, _), sink, status in zip(items, sinks, statuses):
            if status is Status.CORRUPT or (status is Status.MISS and sink.lookup.missing):  # counted below
                self._reject(owner, name, sink.failure or "not a sealed block", sink.lookup)
        return statuses

    def delete(self, key: BlockKey) -> bool:
        return self.inner.delete(self._name(key))

    def keys(self) -> Iterator[BlockKey]:
        return iter(())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pipe.shutdown(wait=True)
        if self._lanes is not None:
            self._lanes.shutdown(wait=True)
        super().close()


class _KeyLookup:
    """The data-key lookup one block is opened with (``lookup_aead`` of :mod:`kvtier.crypto.aead`).
    It remembers what it found, so that a block whose key this process lacks (a miss, kept) is
    told apart from one that failed authentication under a key it holds (tampered, deleted)."""

    __slots__ = ("keyring", "tenant", "found", "missing")

    def __init__(self, keyring: Keyring, tenant: str) -> None:
        self.keyring = keyring
        self.tenant = tenant
        self.found = False  #: the block's key was found (so a failure after this is its tag)
        self.missing = False  #: the block names a key the key store does not hold, even re-read

    def __call__(self, epoch: int, key_id: bytes):
        key = self.keyring.key_for_read(self.tenant, epoch, key_id)
        self.found, self.missing = key is not None, key is None
        return key.aead if key is not None else None


class _OpeningSink(aead.OpeningSink):
    """An opening sink whose verdict on a block sealed under a key it lacks is
    :class:`~kvtier.tiers.streams.Unverifiable`: the streaming tier answers a miss and keeps it."""

    def __init__(self, lookup: _KeyLookup, **kw) -> None:
        super().__init__(lookup, **kw)
        self.lookup = lookup

    def pieces(self):
        why = yield from super().pieces()
        if why is not None and self.lookup.missing:
            why = self.failure = Unverifiable(why)
        return why

