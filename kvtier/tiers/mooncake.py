"""``mooncake``: a Mooncake Store fleet (a master + memory segments on many nodes) behind the tier contract.

::

    tier = MooncakeTier("10.0.0.5:50051", "http://10.0.0.5:8080/metadata", tenant="acme", secret=secret)
    store = TieredStore([HostTier(...), DiskTier(...), tier])          # or EncryptedTier(tier, keyring, "acme")

The engine is treated as untrusted shared storage: it authenticates nobody (any
process can claim any tenant id, read, overwrite or remove any object whose name it
knows), has no deadline of its own, and forgets its index when the master restarts.
What kvtier adds:

* **Keyed names.** A block is stored under ``kvtier/<hex HMAC-SHA256(secret, key)>``:
  the per-tenant ``secret`` makes names unguessable and unlinkable to prompts, and
  another tenant (another secret) can never name, hence never read, our blocks.
* **Verified reads.** An object is ``header | payload``
  (:mod:`kvtier.core.payload`); the header's checksum field holds a *keyed* tag,
  HMAC(secret, name, size, xxh3-128(payload)), so a torn transfer, an object moved to
  another name, or one overwritten by anyone without the secret fails: it is
  :attr:`Status.CORRUPT` (a miss, counted) and is removed. Sealed through
  :class:`~kvtier.tiers.encrypted.EncryptedTier` the engine only ever holds ciphertext.
* **Bounded.** Each call has one deadline, ``max(timeout_s, bytes / min_rate_bytes_s)``;
  the engine call runs on a worker thread and the tier stops waiting at the deadline:
  the blocks are :attr:`Status.ERROR` (misses), lookups ``0`` / ``False``. A call that
  overran keeps the staging buffers it was given until it ends, so it never writes into
  memory handed back. After an overrun or a master that does not answer (-900) the
  tier is *down* for a backoff that doubles up to ``max_backoff_s``: calls return
  misses at once; then a health check decides.
* **Content addressed.** The engine's ``put`` keeps an existing object and answers 0,
  which is the contract's "put of a present key is a no-op" -- and safe, because
  whatever is kept is verified on every read (and dropped if it fails).
* **Leases.** Each read grants a lease (10 s by default) during which the engine
  refuses ``remove`` (-706). ``delete`` does not force it: the name is hidden from this
  tier's reads and lookups at once and its removal retried on later deletes and puts;
  a put of the key brings it back. Only a block that failed verification is removed
  by force (it can never verify).
* **Replicas.** ``replicas`` copies on distinct holders. The engine always reads the
  first replica and does not fall back to another when its holder is dead (it answers
  -800 until the master drops the holder after its ``client_ttl``). A read that fails
  so asks the master for the replicas and reads another one straight from its holder,
  through the client's own transfer engine, within the same call (holders that failed
  lately are tried last); what it reads is verified like any read.
* **Eviction.** Above ~90 % fill the engine silently drops old objects; lookups ask the
  master (``batch_is_exist``) each time, so they never promise what it dropped.

Blocks of 2 MiB and more move in *sessions*: a put session reserves every object of a batch
in one master RPC and publishes them in another, as the engine's own batch put does; a get
session asks the master once for the batch's replicas (granting the leases). Within one, each
block moves in a call of its own, the calls running together: a put starts every payload's
transfer at once and hashes the blocks while they move, then writes all the header rows in one
more call (an object is published only once both landed whole); a get verifies each block as
its call ends, while the others still transfer. (Calls that each asked the master again
cost more than the overlap won.) Smaller blocks move in batch calls.

Zero copy where it is safe: puts send ``header | caller's buffer`` as one object
straight from the caller's memory (an overrun put keeps the headers and buffers referenced
until it ends; a buffer changed under an overrun put is stored torn and then fails
verification). Gets into memory the caller registered once
(:meth:`MooncakeTier.register_memory`: an engine's KV cache, a host pool) are received
straight into it and verified in place; any other get lands in registered staging buffers
and is verified while copied out (a late write after an overrun can only land in memory
registered for it: :meth:`MooncakeTier.quiesce`).

``keys()`` lists nothing (names are one-way); ``capacity_bytes`` is what the caller
configured (0: the fleet's, unknown here); evictions are the engine's and are not
reported through ``on_evict``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import FLAG_CHECKSUM, HEADER_NBYTES, BlockMeta, pack_header, unpack_header
from kvtier.tiers.base import Status, Tier, runs_by_bytes, writable_bytes
from kvtier.tiers.mooncake_client import (
    MASTER_DOWN_CODES,
    RC_BAD_PARAMS,
    RC_HAS_LEASE,
    RC_NO_SPACE,
    RC_NOT_FOUND,
    RC_OBJECT_EXISTS,
    RC_NOT_READY,
    RC_TRANSFER_FAILED,
    BoundedCaller,
    Overrun,
    SharedClient,
)

log = logging.getLogger(__name__)

NAME_PREFIX = "kvtier/"
DEFAULT_MIN_RATE_BYTES_S = 50e6
#: blocks of at least this size move in *sessions*: one master RPC for the batch (as the engine's
#: own batch calls make), then one call per block, all running at once, so that verifying
#: (reads) or hashing (writes) one overlaps the others' transfers. Calls that each asked the
#: master again measured 0.44-0.58x one batch call; one call per block in a session 1.05-1.35x
#: (4 x 8 and 4 x 32 MiB). One block per call: a call of several whose holder died waits ~1 s
#: per block, one after the other.
_SESSION_MIN_BYTES = 2 << 20
#: smaller blocks move as before: a batch call (one master RPC each) of at most this many bytes
_BATCH_CALL_BYTES = 64 << 20
#: at most this much of a read in flight (staging it holds), in at most this many calls
_INFLIGHT_BYTES = 128 << 20
_INFLIGHT_CALLS = 8
#: how long a holder that failed a read is tried after the other replicas
_SUSPECT_S = 30.0
#: pieces a verified payload is copied out in: each is hashed while still in cache
_COPY_PIECE = 1 << 20
_NAME_LABEL = b"kvtier mooncake name\0"
_TAG_LABEL = b"kvtier mooncake tag\0"


class _Down(Exception):
    """The tier is backing off after a failure (internal: becomes a status)."""


class _Late(_Down):
    """An engine call overran its deadline and may still be running."""


class MooncakeTier(Tier):
    name = "mooncake"

    def __init__(
        self,
        master: str,
        metadata: str = "P2PHANDSHAKE",
        *,
        tenant: str,
        secret: bytes,
        hostname: str = "127.0.0.1",
        replicas: int = 1,
        timeout_s: float = 2.0,
        min_rate_bytes_s: float = DEFAULT_MIN_RATE_BYTES_S,
        read_attempts: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        capacity_bytes: int = 0,
        engine_tenant: str = "default",
        name: str | None = None,
    ) -> None:
        """``master``: the master's RPC ``host:port``; ``metadata``: its HTTP metadata URL (or
        ``P2PHANDSHAKE``); ``hostname``: the address other nodes reach this process at.
        ``secret`` (>= 16 bytes) keys names and tags: every process of one tenant shares it."""
        super().__init__()
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("secret: give at least 16 random bytes, the same for every process of the tenant")
        if replicas < 1:
            raise ValueError(f"replicas={replicas}; give 1 or more")
        if timeout_s <= 0 or min_rate_bytes_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and min_rate_bytes_s ({min_rate_bytes_s}) must be positive")
        self.master = master
        self.tenant = tenant
        self._secret = hmac.new(bytes(secret), b"tenant\0" + tenant.encode(), hashlib.sha256).digest()
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self.read_attempts = max(1, read_attempts)
        self._capacity = capacity_bytes
        if name:
            self.name = name
        self._client = SharedClient.acquire(master, metadata, hostname, engine_tenant=engine_tenant)
        self._engine = self._client.store
        self._staging = self._client.staging
        self._caller = BoundedCaller()
        from mooncake.store import ReplicateConfig

        self._config = ReplicateConfig()
        self._config.replica_num = replicas
        self._backoff_min = backoff_s
        self._backoff_max = max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0
        self._closed = False
        self.last_error: str | None = None
        self._unremoved: dict[str, float] = {}  # name → when its removal was refused (a lease)
        self._regions: list[tuple[int, int, object]] = []  # (start, end, the caller's buffer) registered
        self._late_direct_reads = 0
        self._direct_overruns = 0
        self._transfer = self._client.transfer
        self._suspect: dict[str, float] = {}  # a holder's endpoint → until when reads try it last
        self._next_removal_retry = 0.0

    # -- names and tags -------------------------------------------------------------------------
    def _digest(self, key: BlockKey) -> bytes:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"keys are {KEY_BYTES} bytes (kvtier.core.keys), got {key!r:.40}")
        return hmac.new(self._secret, _NAME_LABEL + bytes(key), hashlib.sha256).digest()

    def storage_name(self, key: BlockKey) -> str:
        """The engine's name of a block: one-way, and distinct per tenant."""
        return NAME_PREFIX + self._digest(key).hex()

    def _tag(self, digest: bytes, nbytes: int, payload_hash: bytes) -> bytes:
        msg = _TAG_LABEL + digest + nbytes.to_bytes(8, "little") + payload_hash
        return hmac.new(self._secret, msg, hashlib.sha256).digest()[:16]

    # -- deadlines, failures, backoff ---------------------------------------------------------
    def _deadline_in(self, nbytes: int = 0) -> float:
        return max(self.timeout_s, nbytes / self.min_rate_bytes_s)

    def _check_up(self) -> None:
        if self._closed:
            raise _Down("tier closed")
        if time.monotonic() < self._down_until:
            raise _Down(self.last_error or "down")

    def _call(self, deadline: float, fn, *args, if_late=None):
        """One engine call, waited for until ``deadline`` (monotonic); an overrun puts the tier in
        backoff and raises :class:`_Late` (its buffers are the call's until ``if_late`` runs)."""
        return self._wait(self._caller.submit(fn, *args), deadline, if_late=if_late)

    def _wait(self, future, deadline: float, *, if_late=None):
        """The result of a submitted engine call, as :meth:`_call` waits for it."""
        try:
            return self._caller.wait(future, deadline - time.monotonic(), if_late=if_late)
        except Overrun as exc:
            self._failed(str(exc))
            raise _Late(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the binding raising is the engine failing, not the caller
            self._failed(f"{type(exc).__name__}: {exc}")
            raise _Down(str(exc)) from None

    def _failed(self, why: str) -> None:
        with self._lock:
            self.stats.errors += 1
            self.last_error = why
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)
        log.warning("mooncake tier %s: %s (backing off)", self.master, why)

    def _succeeded(self) -> None:
        self._backoff = self._backoff_min

    def _codes(self, codes: Sequence[int]) -> None:
        """Note what a batch's return codes say about the master."""
        if any(c in MASTER_DOWN_CODES for c in codes):
            self._failed(f"the master did not answer (rc={min(codes)})")
        else:
            self._succeeded()

    @property
    def available(self) -> bool:
        """False while in backoff after a failure."""
        return not self._closed and time.monotonic() >= self._down_until

    def healthy(self) -> bool:
        """The engine's own check (the master answers), bounded by ``timeout_s``."""
        try:
            self._check_up()
            return self._call(time.monotonic() + self.timeout_s, self._engine.health_check) == 0
        except _Down:
            return False

    # -- memory the engine may write into directly ------------------------------------------------
    def register_memory(self, buf) -> None:
        """Register ``buf`` (a writable buffer the caller reads blocks into again and again: an
        engine's KV cache, a host pool) with the engine, once: reads whose output lies inside it
        are received straight into it and verified in place, with no staging copy.

        The price: a read that overran its deadline returned misses, but the engine may still
        land those blocks' bytes (the stored ones, verified by nobody) in this memory until it
        ends. :meth:`quiesce` waits for that; :attr:`late_direct_reads` counts such reads. Memory
        never registered is never written by a late call (it reads through staging)."""
        view = writable_bytes(buf)
        arr = np.frombuffer(view, dtype=np.uint8)
        start = arr.ctypes.data
        rc = self._engine.register_buffer(start, arr.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake: register_buffer({arr.nbytes} bytes) returned {rc}")
        with self._lock:
            self._regions.append((start, start + arr.nbytes, arr))

    def unregister_memory(self, buf) -> None:
        """Stop receiving into ``buf`` (after :meth:`quiesce`, if a read may have overrun)."""
        start = np.frombuffer(writable_bytes(buf), dtype=np.uint8).ctypes.data
        with self._lock:
            found = [r for r in self._regions if r[0] == start]
            self._regions = [r for r in self._regions if r[0] != start]
        if found:
            self._engine.unregister_buffer(start)

    @property
    def late_direct_reads(self) -> int:
        """Reads into registered memory that overran and have not ended yet."""
        return self._late_direct_reads

    def quiesce(self, timeout_s: float = 30.0) -> bool:
        """Wait until no overrun read can still write into registered memory; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._late_direct_reads > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    @property
    def direct_overruns(self) -> int:
        """Reads into registered memory that overran, ever: a caller that sees it change across its
        own call knows a late write may still land in the registered memory it read into."""
        return self._direct_overruns

    def _note_late_direct_read(self) -> None:
        with self._lock:
            self._late_direct_reads += 1
            self._direct_overruns += 1

    def _registered_address(self, view: memoryview) -> int | None:
        """The address of ``view`` if all of it lies in registered memory, else None."""
        if not self._regions or view.nbytes == 0:
            return None
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        end = addr + view.nbytes
        for start, stop, _ in self._regions:
            if start <= addr and end <= stop:
                return addr
        return None

    # -- lookups --------------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        names = [self.storage_name(k) for k in keys]
        if not names:
            return []
        try:
            self._check_up()
            codes = self._call(time.monotonic() + self._deadline_in(), self._engine.batch_is_exist, names)
        except _Down:
            return [False] * len(names)
        self._codes(codes)
        hidden = self._hidden()
        return [c == 1 and n not in hidden for c, n in zip(codes, names)]

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for present in self.contains_many(keys):
            if not present:
                break
            n += 1
        return n

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: BlockKey, out) -> Status:
        return self.get_many([key], [out])[0]

    #: :meth:`get_many` takes ``hash_payloads=False`` (a caller whose payloads authenticate themselves)
    reads_unhashed = True

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence, *, hash_payloads: bool = True) -> list[Status]:
        """``hash_payloads=False``: for a caller whose payloads authenticate themselves (an
        :class:`~kvtier.tiers.encrypted.EncryptedTier`'s AES-GCM blocks, whose tags bind the tenant,
        the block's name and its size): each object's header must still name this block at this
        size, but the payload's keyed tag is not checked (its xxh3 over the payload not computed):
        the caller's own authentication is the check, and what fails it the caller deletes."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        views = [writable_bytes(o) for o in outs]
        digests = [self._digest(k) for k in keys]
        deadline = time.monotonic() + self._deadline_in(sum(v.nbytes for v in views))
        statuses = [Status.ERROR] * len(keys)
        hidden = self._hidden()
        rounds: list[list[int]] = []  # the engine reads a name once per batch: a repeated key waits a round
        seen: dict[bytes, int] = {}
        for i, d in enumerate(digests):
            if NAME_PREFIX + d.hex() in hidden:
                statuses[i] = Status.MISS
                continue
            r = seen[d] = seen.get(d, -1) + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for todo in rounds:
            self._read_round(todo, digests, views, statuses, deadline, hash_payloads)
        self._count_reads(statuses, views)
        return statuses

    def _read_round(self, todo: list[int], digests, views, statuses: list[Status], deadline: float,
                    hashed: bool) -> None:
        for _ in range(self.read_attempts):
            try:
                self._check_up()
                small = [i for i in todo if views[i].nbytes < _SESSION_MIN_BYTES]
                retry = self._read_pieces(small, digests, views, statuses, deadline, session=False, hashed=hashed)
                big = [i for i in todo if views[i].nbytes >= _SESSION_MIN_BYTES]
                if big:
                    retry += self._read_in_session(big, digests, views, statuses, deadline, hashed)
            except _Down:
                break
            # A dead holder answers -800 until the master drops it (its client_ttl), and the engine
            # always reads the first replica: read the others ourselves, at once. What is still
            # unread is tried again; once the master has dropped the holder, a block with no other
            # copy is gone (a miss).
            if retry and self.replicas > 1 and self._transfer is not None:
                try:
                    retry = self._read_other_replicas(retry, digests, views, statuses, deadline, hashed)
                except _Down:
                    break
            todo = retry
            if not todo or time.monotonic() >= deadline:
                break

    def _read_in_session(self, todo: list[int], digests, views, statuses: list[Status],
                         deadline: float, hashed: bool) -> list[int]:
        """Read ``todo`` in one get session: the master is asked once for every block's replicas
        (and grants their leases), then the blocks move one per call, the calls running
        together; each is verified as soon as it lands, while the later ones still transfer.
        Returns the indices a holder failed to serve."""
        names = [NAME_PREFIX + digests[i].hex() for i in todo]
        self._client.sessions_opening(names)
        try:
            codes = self._call(deadline, self._engine.batch_get_session_start, names)
            self._codes(codes)
            found = []
            for i, name, code in zip(todo, names, codes):
                if code == 0:
                    found.append(i)
                elif code in (RC_NOT_FOUND, RC_NOT_READY):
                    statuses[i] = Status.MISS  # absent, or still being written by another put
                else:
                    log.info("mooncake tier: lookup of %s… failed (rc=%d)", name[len(NAME_PREFIX):][:16], code)
                    statuses[i] = Status.ERROR
            return self._read_pieces(found, digests, views, statuses, deadline, session=True, hashed=hashed)
        finally:
            ending = self._client.sessions_closing(names)
            if ending:
                # Waited for only within the read's own deadline (a little grace once it has
                # passed): ending the leases is a courtesy (they expire on their own), and with a
                # holder frozen mid-read the end waited a whole timeout more, doubling the call.
                end = self._caller.submit(self._engine.batch_get_session_end, ending)
                try:
                    self._caller.wait(end, max(deadline - time.monotonic(), 0.01))
                except Overrun:
                    log.debug("mooncake tier: ending a get session ran past the read's deadline")
                except Exception as exc:  # noqa: BLE001 - the read is done; the leases lapse
                    log.debug("mooncake tier: ending a get session failed: %s", exc)

    def _read_pieces(self, found: list[int], digests, views, statuses: list[Status], deadline: float, *,
                     session: bool, hashed: bool) -> list[int]:
        """Read ``found`` in calls started as the in-flight bounds allow (in an open session: one
        block per call; else batch calls, each asking the master), each verified as it ends.
        Returns the indices a holder failed to serve."""
        failed: list[int] = []
        pending: deque[_ChunkRead] = deque()
        inflight = 0
        sizes = [views[i].nbytes + HEADER_NBYTES for i in found]
        pieces = [[i] for i in found] if session else runs_by_bytes(found, sizes, _BATCH_CALL_BYTES)
        try:
            for piece in pieces:
                nbytes = sum(views[i].nbytes + HEADER_NBYTES for i in piece)
                while pending and (inflight + nbytes > _INFLIGHT_BYTES or len(pending) >= _INFLIGHT_CALLS):
                    read = pending.popleft()
                    inflight -= read.nbytes
                    failed += self._finish_chunk(read, digests, views, statuses, deadline, hashed)
                self._check_up()
                pending.append(self._start_chunk(piece, digests, views, session, hashed))
                inflight += nbytes
            while pending:
                failed += self._finish_chunk(pending.popleft(), digests, views, statuses, deadline, hashed)
        except _Down:
            for read in pending:  # started, never waited for: their buffers are theirs until they end
                if read.headers is not None:
                    self._note_late_direct_read()
                read.future.add_done_callback(
                    lambda _f, r=read: r.late_ended() if r.headers is not None else r.give_back())
            raise
        return failed

    def _read_other_replicas(self, todo: list[int], digests, views, statuses: list[Status],
                             deadline: float, hashed: bool) -> list[int]:
        """Read each block of ``todo`` from a replica other than the first (the one the engine
        failed on), holders that failed lately last; returns the blocks no replica served."""
        names = [NAME_PREFIX + digests[i].hex() for i in todo]
        descs = self._call(deadline, self._engine.batch_get_replica_desc, names)
        left: list[int] = []
        for i, name in zip(todo, names):
            replicas = []
            for r in descs.get(name, [])[1:] + descs.get(name, [])[:1]:
                if r.is_memory_replica():
                    replicas.append(r.get_memory_descriptor().buffer_descriptor)
            now = time.monotonic()
            replicas.sort(key=lambda b: self._suspect.get(b.transport_endpoint, 0.0) > now)  # stable
            n = views[i].nbytes + HEADER_NBYTES
            served = False
            for b in replicas:
                if b.size != n:
                    statuses[i] = Status.BAD_SIZE
                    served = True
                    break
                staged = self._staging.take(n)
                rc = self._call(deadline, self._transfer.transfer_sync_read, b.transport_endpoint,
                                staged[1].ctypes.data, b.buffer_address, n,
                                if_late=lambda st=staged: self._staging.give(st))
                try:
                    if rc == 0:
                        statuses[i] = self._verify_into(name, digests[i], staged[1][:n], views[i], hashed)
                        served = True
                        break
                finally:
                    self._staging.give(staged)
                self._suspect[b.transport_endpoint] = time.monotonic() + _SUSPECT_S
            if not served:
                left.append(i)
        return left

    def _start_chunk(self, chunk: list[int], digests, views, session: bool, hashed: bool = True) -> "_ChunkRead":
        """Start reading ``chunk`` in one engine call (ranged, in the open session; else a batch
        call). A block whose output buffer lies in memory registered with
        :meth:`register_memory` is received straight into it (its header into a registered
        scratch row) and verified in place; any other lands in a registered staging buffer and
        is verified while copied out."""
        names = [NAME_PREFIX + digests[i].hex() for i in chunk]
        sizes = [views[i].nbytes + HEADER_NBYTES for i in chunk]
        direct = [self._registered_address(views[i]) for i in chunk]
        headers = self._staging.take(HEADER_NBYTES * len(chunk)) if any(a is not None for a in direct) else None
        bufs = [None if a is not None else self._staging.take(n) for a, n in zip(direct, sizes)]
        ptrs, lens, offsets = [], [], []
        for j, (addr, buf, n) in enumerate(zip(direct, bufs, sizes)):
            if addr is not None:
                ptrs.append([headers[1].ctypes.data + j * HEADER_NBYTES, addr])
                lens.append([HEADER_NBYTES, n - HEADER_NBYTES])
                offsets.append([0, HEADER_NBYTES])
            else:
                ptrs.append([buf[1].ctypes.data])
                lens.append([n])
                offsets.append([0])
        read = _ChunkRead(self, chunk, names, sizes, bufs, headers)
        # Each payload is hashed on the call's worker as soon as the call returns, while it is
        # still in cache and while the batch's other calls still transfer (on the caller's thread,
        # after the calls that run at once have all ended together, it was a serial tail).
        payloads = ([views[i] if buf is None else buf[1][HEADER_NBYTES:n] for i, buf, n in zip(chunk, bufs, sizes)]
                    if hashed else None)
        if session:
            call = (self._engine.batch_get_into_multi_buffer_ranges, names, ptrs, lens, offsets)
        else:
            call = (self._engine.batch_get_into_multi_buffers, names, ptrs, lens)
        read.future = self._caller.submit(read.run_and_hash, payloads, *call)
        return read

    def _finish_chunk(self, read: "_ChunkRead", digests, views, statuses: list[Status],
                      deadline: float, hashed: bool) -> list[int]:
        """Wait for a started read and verify it; returns the indices a holder failed to serve."""
        direct = read.headers is not None
        try:
            codes = self._caller.wait(read.future, deadline - time.monotonic(),
                                      if_late=read.late_ended if direct else read.give_back)
        except Overrun as exc:
            if direct:
                self._note_late_direct_read()
            self._failed(str(exc))
            raise _Late(str(exc)) from None  # the engine may still write: the late call gives back
        except Exception as exc:  # noqa: BLE001 - the binding raising is the engine failing
            read.give_back()
            self._failed(f"{type(exc).__name__}: {exc}")
            raise _Down(str(exc)) from None
        failed: list[int] = []
        try:
            self._codes(codes)
            for j, (i, name, buf, n, code) in enumerate(zip(read.chunk, read.names, read.bufs, read.sizes, codes)):
                if code == n:
                    payload_hash = read.hashes[j] if read.hashes is not None else None
                    if buf is None:
                        row = read.headers[1][j * HEADER_NBYTES:(j + 1) * HEADER_NBYTES]
                        statuses[i] = self._verify_in_place(name, digests[i], row, views[i], hashed, payload_hash)
                    else:
                        statuses[i] = self._verify_into(name, digests[i], buf[1][:n], views[i], hashed,
                                                        payload_hash)
                elif code in (RC_NOT_FOUND, RC_NOT_READY):
                    statuses[i] = Status.MISS  # absent, or still being written by another put
                elif 0 <= code < n or code == RC_BAD_PARAMS:
                    # a smaller object, or one larger than the buffer (or, rarely, a session another
                    # thread's get of the same name ended under this one: a miss either way)
                    statuses[i] = Status.BAD_SIZE
                else:
                    log.info("mooncake tier: read of %s… failed (rc=%d)", name[len(NAME_PREFIX):][:16], code)
                    statuses[i] = Status.ERROR
                    if code == RC_TRANSFER_FAILED:
                        failed.append(i)
        finally:
            read.give_back()
        return failed

    def _header_tag(self, name: str, digest: bytes, header_bytes, n: int) -> bytes | None:
        """The keyed tag of an object's header if the header names this block at this size
        (else the object is dropped: None)."""
        header = unpack_header(header_bytes)
        if header is None or header.key != digest or header.payload_nbytes != n or not header.flags & FLAG_CHECKSUM:
            self._drop(name, "header does not name this block" if header is None or header.key != digest
                       else "size or format differs")
            return None
        return header.checksum

    def _tag_matches(self, name: str, digest: bytes, n: int, payload_hash: bytes, tag: bytes) -> Status:
        if not hmac.compare_digest(self._tag(digest, n, payload_hash), tag):
            self._drop(name, "payload fails its keyed tag (torn, tampered or not ours)")
            return Status.CORRUPT
        return Status.OK

    def _verify_in_place(self, name: str, digest: bytes, header_bytes: np.ndarray, out: memoryview,
                         hashed: bool = True, payload_hash: bytes | None = None) -> Status:
        """A block received straight into the caller's buffer: hashed where it lies (``payload_hash``:
        already, by the call's worker; not at all if the caller authenticates its payloads: then
        only its header is checked)."""
        tag = self._header_tag(name, digest, header_bytes, out.nbytes)
        if tag is None:
            return Status.CORRUPT
        if not hashed:
            return Status.OK
        if payload_hash is None:
            payload_hash = xxhash.xxh3_128_digest(out)
        return self._tag_matches(name, digest, out.nbytes, payload_hash, tag)

    def _verify_into(self, name: str, digest: bytes, staged: np.ndarray, out: memoryview,
                     hashed: bool = True, payload_hash: bytes | None = None) -> Status:
        """A block received into staging: hashed piece by piece while copied out (``payload_hash``:
        hashed already, by the call's worker, in staging that nothing writes once the call ended;
        not at all if the caller authenticates its payloads: then only its header is checked)."""
        n = out.nbytes
        tag = self._header_tag(name, digest, staged[:HEADER_NBYTES], n)
        if tag is None:
            return Status.CORRUPT
        payload = staged[HEADER_NBYTES:]
        dst = np.frombuffer(out, dtype=np.uint8)
        if not hashed or payload_hash is not None:
            if payload_hash is not None and self._tag_matches(name, digest, n, payload_hash, tag) is not Status.OK:
                return Status.CORRUPT  # (nothing copied: the caller's buffer keeps what it held)
            dst[:] = payload[:n]
            return Status.OK
        hasher = xxhash.xxh3_128()
        for start in range(0, n, _COPY_PIECE):  # hash each piece while in cache, then copy it
            piece = payload[start : start + _COPY_PIECE]
            hasher.update(piece)
            dst[start : start + _COPY_PIECE] = piece
        return self._tag_matches(name, digest, n, hasher.digest(), tag)

    def _drop(self, name: str, why: str) -> None:
        """Remove an object that can never verify (forced: a lease protects nothing worth keeping)."""
        log.warning("mooncake tier: block %s… rejected: %s; removing it", name[len(NAME_PREFIX):][:16], why)
        try:
            self._call(time.monotonic() + self.timeout_s, self._engine.remove, name, True)
        except _Down:
            pass

    def _count_reads(self, statuses: list[Status], views) -> None:
        with self._lock:
            for s, v in zip(statuses, views):
                if s is Status.OK:
                    self.stats.hits += 1
                    self.stats.bytes_read += v.nbytes
                elif s is Status.CORRUPT:
                    self.stats.verify_failures += 1
                elif s is not Status.ERROR:
                    self.stats.misses += 1

    # -- writes ---------------------------------------------------------------------------------
    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None) -> Status:
        return self.put_many([key], [data], parents=[parent], metas=[meta])[0]

    def put_many(self, keys: Sequence[BlockKey], datas: Sequence, *, parents=None,
                 metas: Sequence[BlockMeta | None] | None = None) -> list[Status]:
        if len(keys) != len(datas):
            raise ValueError(f"put_many: {len(keys)} keys but {len(datas)} buffers")
        views = [np.frombuffer(memoryview(d).cast("B"), dtype=np.uint8) for d in datas]
        metas = metas or [None] * len(keys)
        digests = [self._digest(k) for k in keys]
        names = [NAME_PREFIX + d.hex() for d in digests]
        statuses = [Status.ERROR] * len(keys)
        first: dict[str, int] = {}  # a key twice in one batch is put once (content addressed)
        todo = []
        for i in range(len(keys)):
            if views[i].nbytes == 0:
                statuses[i] = Status.TOO_LARGE  # an empty block is not a block
            elif first.setdefault(names[i], i) == i:
                todo.append(i)
        deadline = time.monotonic() + self._deadline_in(sum(views[i].nbytes for i in todo))
        try:
            self._check_up()
            self._retry_removals(deadline)
            small = [i for i in todo if views[i].nbytes < _SESSION_MIN_BYTES]
            if small:
                self._put_batched(small, names, digests, views, metas, statuses, deadline)
            big = [i for i in todo if views[i].nbytes >= _SESSION_MIN_BYTES]
            if big:
                _PutSession(self, big, names, digests, views, metas).run(statuses, deadline)
        except _Down:
            pass
        for i in range(len(keys)):
            if views[i].nbytes and first[names[i]] != i:
                statuses[i] = statuses[first[names[i]]]
        with self._lock:
            for i, s in enumerate(statuses):
                if s is Status.OK:
                    self.stats.puts += 1
                    self.stats.bytes_written += views[i].nbytes
                else:
                    self.stats.put_failures += 1
        return statuses

    def _put_batched(self, todo: list[int], names, digests, views, metas, statuses: list[Status],
                     deadline: float) -> None:
        """Small blocks: hashed first (a later change of the caller's bytes, even under an overrun
        put, is then a verification failure, not data), then one batch call."""
        headers = np.empty((len(names), HEADER_NBYTES), dtype=np.uint8)
        for i in todo:
            headers[i] = _header_row(self, digests[i], views[i], metas[i])
        ptrs = [[headers[i].ctypes.data, views[i].ctypes.data] for i in todo]
        sizes = [[HEADER_NBYTES, views[i].nbytes] for i in todo]
        # an overrun call still reads the headers and the caller's buffers: kept referenced until it ends
        codes = self._call(deadline, self._engine.batch_put_from_multi_buffers, [names[i] for i in todo], ptrs,
                           sizes, self._config, if_late=lambda: (headers, views))
        self._codes(codes)
        for i, code in zip(todo, codes):
            statuses[i] = Status.OK if code == 0 else Status.FULL if code == RC_NO_SPACE else Status.ERROR
            if code == 0:
                with self._lock:
                    self._unremoved.pop(names[i], None)  # a put brings a hidden key back

    # -- removal --------------------------------------------------------------------------------
    def delete(self, key: BlockKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        names = [self.storage_name(k) for k in keys]
        if not names:
            return []
        out = [False] * len(names)
        deadline = time.monotonic() + self._deadline_in()
        try:
            self._check_up()
            self._retry_removals(deadline)
            codes = self._call(deadline, self._engine.batch_remove, names, False)
        except _Down:
            return out
        self._codes(codes)
        now = time.monotonic()
        with self._lock:
            for j, (name, code) in enumerate(zip(names, codes)):
                if code == 0:
                    out[j] = True
                    self._unremoved.pop(name, None)
                elif code == RC_HAS_LEASE and name not in self._unremoved:
                    # a reader holds it: hidden from this tier now, removed once its lease ends
                    self._unremoved[name] = now
                    out[j] = True
            self.stats.deletes += sum(out)
        return out

    def remove_unverifiable(self, key: BlockKey) -> None:
        """Remove a block that a caller reading it with ``hash_payloads=False`` found failing its own
        authentication (an AES-GCM tag under a key it holds): forced, as a block that fails this
        tier's tag is (a reader's lease protects nothing worth keeping; a plain delete would only
        hide it, and a put of the key would then bring the bad object back)."""
        self._drop(self.storage_name(key), "fails its reader's authentication")
        with self._lock:
            self._unremoved.pop(self.storage_name(key), None)

    def _hidden(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._unremoved) if self._unremoved else frozenset()

    def _retry_removals(self, deadline: float) -> None:
        """Try again to remove what a lease protected; at most once a second."""
        now = time.monotonic()
        with self._lock:
            if not self._unremoved or now < self._next_removal_retry:
                return
            self._next_removal_retry = now + 1.0
            names = list(self._unremoved)
        codes = self._call(deadline, self._engine.batch_remove, names, False)
        with self._lock:
            for name, code in zip(names, codes):
                if code in (0, RC_NOT_FOUND):
                    self._unremoved.pop(name, None)

    # -- the rest of the contract ---------------------------------------------------------------
    def keys(self) -> Iterator[BlockKey]:
        return iter(())  # names are one-way by design

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return 0  # the fleet's fill is the master's to know (its metrics endpoint)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._caller.close()
        if not self._late_direct_reads:  # a late read still uses its registration: leave it to close()
            for start, _, _ in self._regions:
                self._engine.unregister_buffer(start)
        self._regions = []
        self._client.release()

    def __repr__(self) -> str:
        return f"<MooncakeTier master={self.master} tenant={self.tenant!r} replicas={self.replicas}>"


class _PutSession:
    """One batch's write: a put session (the master reserves every object in one RPC), then one
    call per block writing its payload (at the object's offset ``HEADER_NBYTES``), all started at
    once; while they transfer, each block is hashed here and its header row filled, and one more
    call writes every header (offset 0); then one RPC publishes what was written whole (payload
    *and* header); whatever was reserved and not published is revoked.

    Hashing while the transfer runs (not before it starts, which put the first block's hash,
    ~1 ms at 8 MiB, ahead of every transfer) is as safe: only what is published is readable,
    and a block is published only after both its calls returned whole, within the deadline, so
    its stored payload verifies only if it equals what was hashed here from the caller's buffer
    during this call. A buffer changed under the put is stored torn and fails verification;
    an overrun put publishes nothing. A call that overran keeps the headers and the caller's
    buffers referenced until it ends; the session's reservations are revoked then."""

    def __init__(self, tier: MooncakeTier, todo: list[int], names, digests, views, metas) -> None:
        self.tier, self.todo, self.names, self.digests, self.views, self.metas = tier, todo, names, digests, views, metas
        self.headers = np.empty((len(names), HEADER_NBYTES), dtype=np.uint8)
        self.reserved: list[int] = []
        self._running = 0  # calls not yet ended, while late
        self._lock = threading.Lock()

    def run(self, statuses: list[Status], deadline: float) -> None:
        tier, todo, names, views = self.tier, self.todo, self.names, self.views
        sizes = [views[i].nbytes + HEADER_NBYTES for i in todo]
        start = tier._caller.submit(tier._engine.batch_put_session_start, [names[i] for i in todo], sizes,
                                    tier._config)
        calls: list[tuple[list[int], object, int | None]] = []  # (blocks, call, bytes each wrote whole; None: header)
        try:
            reserved = self._reserved(tier._wait(start, deadline, if_late=lambda: self._late_start(start)), statuses)
            go = [i for i in todo if i in reserved]
            for i in go:  # one block per call: see _SESSION_MIN_BYTES
                fut = tier._caller.submit(tier._engine.batch_put_from_multi_buffer_ranges, [names[i]],
                                          [[views[i].ctypes.data]], [[views[i].nbytes]], [[HEADER_NBYTES]])
                calls.append(([i], fut, views[i].nbytes))
            for i in go:
                self.headers[i] = _header_row(tier, self.digests[i], views[i], self.metas[i])
            if go:
                fut = tier._caller.submit(tier._engine.batch_put_from_multi_buffer_ranges, [names[i] for i in go],
                                          [[self.headers[i].ctypes.data] for i in go], [[HEADER_NBYTES]] * len(go),
                                          [[0]] * len(go))
                calls.append((go, fut, HEADER_NBYTES))
            whole = dict.fromkeys(go, 0)  # block → how many of its two writes came back whole
            while calls:
                blocks, fut, n = calls[0]
                codes = tier._wait(fut, deadline)
                calls.pop(0)
                for i, code in zip(blocks, codes):
                    if code == n:
                        whole[i] += 1
                    else:
                        log.info("mooncake tier: write of %s… failed (rc=%d)", names[i][len(NAME_PREFIX):][:16], code)
            written = [i for i in go if whole[i] == 2]
            if written:
                codes = tier._call(deadline, tier._engine.batch_put_session_end, [names[i] for i in written])
                tier._codes(codes)
                for i, code in zip(written, codes):
                    if code == 0:
                        statuses[i] = Status.OK
                        self.reserved.remove(i)
                        with tier._lock:
                            tier._unremoved.pop(names[i], None)  # a put brings a hidden key back
        except _Down:
            self._late([fut for _, fut, _ in calls])
            raise
        self._revoke()

    def _reserved(self, codes: Sequence[int], statuses: list[Status]) -> set[int]:
        self.tier._codes(codes)
        for i, code in zip(self.todo, codes):
            if code == 0:
                self.reserved.append(i)
            elif code == RC_OBJECT_EXISTS:
                statuses[i] = Status.OK  # content addressed: what is kept is verified on every read
                with self.tier._lock:
                    self.tier._unremoved.pop(self.names[i], None)  # a put brings a hidden key back
            elif code == RC_NO_SPACE:
                statuses[i] = Status.FULL
        return set(self.reserved)

    def _late_start(self, start) -> None:
        """The reservation overran and has now ended: give back whatever it reserved."""
        try:
            self.reserved = [i for i, code in zip(self.todo, start.result()) if code == 0]
        except Exception:  # noqa: BLE001 - it reserved nothing
            return
        self._revoke()

    def _late(self, futures) -> None:
        """Calls still running after an overrun: revoke the reservations once the last one ends
        (until then they read ``self.headers`` and the caller's buffers, referenced here)."""
        running = [f for f in futures if not f.done()]
        if not running:
            self._revoke()
            return
        self._running = len(running)
        for f in running:
            f.add_done_callback(self._one_ended)

    def _one_ended(self, _future) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self._revoke()

    def _revoke(self) -> None:
        if not self.reserved or self.tier._closed:  # a closed tier's client is gone: the master times them out
            return
        names, self.reserved = [self.names[i] for i in self.reserved], []
        try:
            self.tier._engine.batch_put_session_revoke(names)
        except Exception as exc:  # noqa: BLE001 - the engine's to clean up after its put timeout
            log.debug("mooncake tier: revoking %d reservations failed: %s", len(names), exc)


class _ChunkRead:
    """One started engine read: its buffers (registered staging, header rows) are the call's until
    it ends; :meth:`give_back` returns them to the pool exactly once."""

    def __init__(self, tier: MooncakeTier, chunk, names, sizes, bufs, headers) -> None:
        self.tier, self.chunk, self.names, self.sizes, self.bufs, self.headers = tier, chunk, names, sizes, bufs, headers
        self.nbytes = sum(sizes)
        self.future = None
        #: xxh3-128 of each payload the call read whole (None: not hashed, or not read whole)
        self.hashes: list[bytes | None] | None = None
        self._given = False
        self._lock = threading.Lock()

    def run_and_hash(self, payloads, fn, *args):
        """On the engine call's worker: the call, then the hash of every payload it read whole."""
        codes = fn(*args)
        if payloads is not None and not isinstance(codes, int):
            self.hashes = [xxhash.xxh3_128_digest(p) if code == n else None
                           for p, code, n in zip(payloads, codes, self.sizes)]
        return codes

    def give_back(self) -> None:
        with self._lock:
            if self._given:
                return
            self._given = True
        for b in self.bufs:
            if b is not None:
                self.tier._staging.give(b)
        if self.headers is not None:
            self.tier._staging.give(self.headers)

    def late_ended(self) -> None:
        """An overrun read into registered memory has ended: nothing can land there any more."""
        self.give_back()
        with self.tier._lock:
            self.tier._late_direct_reads -= 1


def _header_row(tier: MooncakeTier, digest: bytes, view: np.ndarray, meta) -> np.ndarray:
    """The header an object starts with: the block's name digest, size, keyed tag and meta."""
    n = view.nbytes
    tag = tier._tag(digest, n, xxhash.xxh3_128_digest(view))
    return np.frombuffer(pack_header(digest, n, tag, meta, flags=FLAG_CHECKSUM), np.uint8)
