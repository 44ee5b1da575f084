"""``EncryptedTier``: seals blocks for one tenant before they reach the tier below.

Wraps any tier (disk, remote, host). ``put`` seals the block (chunked AES-256-GCM,
:mod:`kvtier.crypto.aead`) into a reusable page-aligned staging buffer and stores
the sealed bytes under the tenant's keyed storage name (HMAC of the block key);
``get`` fetches the sealed bytes and opens them into the caller's buffer. A
block that fails authentication -- tampered, truncated, moved to another key or
tenant, sealed under a retired or shredded epoch -- is :attr:`Status.CORRUPT`:
counted in ``verify_failures``, logged, never returned.

Over a remote tier this is end-to-end encryption: the server only ever stores
ciphertext under names it cannot link to prompts.

Not supported: demotion *out of* an encrypted tier (the store would need the
plaintext and the client key back); blocks it evicts are dropped. ``keys()``
lists nothing: storage names are one-way by design.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.core.framing import frame_str
from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.crypto import aead
from kvtier.crypto.keyring import Keyring
from kvtier.tiers.base import Status, Tier
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


class EncryptedTier(WrappingTier):
    def __init__(
        self,
        inner: Tier,
        keyring: Keyring,
        tenant: str,
        *,
        chunk_bytes: int = aead.DEFAULT_CHUNK_BYTES,
        threads: int = 2,
    ) -> None:
        super().__init__(inner)
        self.name = f"encrypted({inner.name})"
        self.keyring = keyring
        self.tenant = tenant
        self.chunk_bytes = chunk_bytes
        self._context = frame_str(1, "tenant") + frame_str(2, tenant)
        self._staging = _Staging()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-aead") if threads > 1 else None

    @property
    def on_evict(self):
        return None

    @on_evict.setter
    def on_evict(self, _hook) -> None:
        pass  # see module docstring: no demotion out of an encrypted tier

    def storage_name(self, key: BlockKey) -> BlockKey:
        """The keyed name a block is stored under in the inner tier."""
        return BlockKey(self.keyring.storage_key(self.tenant, key))

    _name = storage_name

    def _lookup(self, epoch: int, key_id: bytes):
        key = self.keyring.key_for_read(self.tenant, epoch, key_id)
        return key.aead if key is not None else None

    # -- contract ---------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.inner.contains(self._name(key))

    def lookup_prefix(self, keys) -> int:
        return self.inner.lookup_prefix([self._name(k) for k in keys])

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None) -> Status:
        name = self._name(key)
        if self.inner.contains(name):
            return Status.OK
        plain = memoryview(data).cast("B")
        staging = self._staging.get(aead.sealed_nbytes(plain.nbytes, self.chunk_bytes))
        data_key = self.keyring.key_for_write(self.tenant)
        n = aead.seal_into(
            data_key.aead,
            epoch=data_key.epoch,
            key_id=data_key.key_id,
            storage_key=name,
            context=self._context,
            plain=plain,
            out=staging,
            chunk_bytes=self.chunk_bytes,
            executor=self._pool,
        )
        self.keyring.note_encryptions(data_key, aead.n_chunks(plain.nbytes, self.chunk_bytes))
        # meta stays out: dtype and shape are not secret-free (they reveal the model).
        return self.inner.put(name, staging[:n], parent=self._name(parent) if parent else None)

    def get(self, key: BlockKey, out) -> Status:
        dst = memoryview(out).cast("B")
        name = self._name(key)
        staging = self._staging.get(aead.sealed_nbytes(dst.nbytes, self.chunk_bytes))
        status = self.inner.get(name, staging)
        if status is not Status.OK:
            return status
        why = aead.open_into(
            self._lookup, storage_key=name, context=self._context, sealed=staging, out=dst, executor=self._pool
        )
        if why is not None:
            with self._lock:
                self.inner.stats.verify_failures += 1
            log.warning("encrypted block %s… of tenant %r rejected: %s", name.hex()[:16], self.tenant, why)
            self.inner.delete(name)  # it will never verify: free the space
            return Status.CORRUPT
        return Status.OK

    def delete(self, key: BlockKey) -> bool:
        return self.inner.delete(self._name(key))

    def keys(self) -> Iterator[BlockKey]:
        return iter(())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        super().close()
