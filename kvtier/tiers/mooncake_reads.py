"""The read path of :class:`~kvtier.tiers.mooncake.MooncakeTier`: lookups aside, every ``get``.

Blocks below the session size move in batch calls; larger ones in a get session (the master
asked once for the batch's replicas, granting leases), one call per block, the calls running
together, each block verified as its call ends while the others still transfer. A block whose
output lies in memory registered with :meth:`TierReads.register_memory` is received straight
into it and verified in place; any other lands in registered staging and is verified while
copied out. A read the engine's first replica failed is sent to another replica's holder at
once. Every object's header must name the block at its size and its payload match its keyed
tag, or it is :attr:`~kvtier.tiers.base.Status.CORRUPT` (a miss) and removed -- unless a removal
explains the failure: a forced removal breaks the lease of a read under way and the engine
reuses the memory at once, so the read receives another object's bytes. A failed read that a
removal of the name by this tier overlapped (:class:`~kvtier.tiers.mooncake.RemovalLog`) is a
miss, and nothing is removed (the name may already hold a block a later put stored); any other
failed read is read once more (another process's delete), and only an object that fails again
is ``CORRUPT``.

A get session is the client's, per name, shared by this process's reads of it; another read's
session start that finds the name removed or not yet published (-704, -703) drops it, and a read
under way in it then answers -600 though the name may hold the block again, at its size (a delete
and a put of the block meanwhile). Nothing failed: such a read is made once more, in a session of
its own, while its deadline allows, and a miss if that one loses its session too (an ``ERROR``
said the tier failed).

An object of another size than the buffer asked for (a short read, -600 "larger than the
buffer", -800 from a batch call, or a header naming another size) is read whole and judged
(:meth:`TierReads._judge_resized`): this block, whole and tagged, at that size is the caller's
mistake (``BAD_SIZE``, kept); anything else is ``CORRUPT`` and removed. Kept, a resized forgery
poisoned its key for good (the engine's put keeps what a name holds); and -800 read as a failed
holder was retried, then an ``ERROR`` that an EncryptedTier took for no proof of tampering.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.payload import HEADER_NBYTES, BlockHeader, unpack_header
from kvtier.tiers.base import Status, runs_by_bytes, writable_bytes
from kvtier.tiers.mooncake_calls import Down, FollowUp, Late, log
from kvtier.tiers.mooncake_client import RC_BAD_PARAMS, RC_NOT_FOUND, RC_NOT_READY, RC_TRANSFER_FAILED, Overrun
from kvtier.tiers.mooncake_names import NAME_ID_BYTES, NAME_PREFIX, names_block, salt_of

if TYPE_CHECKING:
    from kvtier.tiers.mooncake import MooncakeTier

#: smaller blocks move as before: a batch call (one master RPC each) of at most this many bytes
_BATCH_CALL_BYTES = 64 << 20
#: at most this much of a read in flight (staging it holds), in at most this many calls
_INFLIGHT_BYTES = 128 << 20
_INFLIGHT_CALLS = 8
#: how long a holder that failed a read is tried after the other replicas
_SUSPECT_S = 30.0
#: pieces a verified payload is copied out in: each is MACed while still in cache
_COPY_PIECE = 1 << 20


class _Rejected(NamedTuple):
    """A read whose object failed verification, not judged yet (:meth:`TierReads._judge_rejected`):
    held in the read's statuses until then."""

    why: str


class _SessionLost(NamedTuple):
    """A session read the engine refused (-600) while the name held an object of the block's size:
    another read of the name dropped the session (see the module's docstring). Held in the read's
    statuses until :meth:`TierReads._read_lost_again`; a miss if still lost then."""


class TierReads:
    """``get`` / ``get_many`` and the memory reads may land in straight (a mixin of the tier)."""

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
        with self._registration:
            if self._closed:  # its engine may be closed: reads after close miss anyway
                raise RuntimeError("mooncake: register_memory on a closed tier")
            rc = self._engine.register_buffer(start, arr.nbytes)
            if rc != 0:
                raise RuntimeError(f"mooncake: register_buffer({arr.nbytes} bytes) returned {rc}")
            with self._lock:
                self._regions.append((start, start + arr.nbytes, arr))

    def unregister_memory(self, buf) -> None:
        """Stop receiving into ``buf`` (after :meth:`quiesce`, if a read may have overrun)."""
        start = np.frombuffer(writable_bytes(buf), dtype=np.uint8).ctypes.data
        with self._registration:
            if self._closed:  # close() unregisters what is left (or leaves it to a late read)
                return
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

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: BlockKey, out) -> Status:
        return self.get_many([key], [out])[0]

    #: :meth:`get_many` takes ``hash_payloads=False`` (a caller whose payloads authenticate themselves)
    reads_unhashed = True

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence, *, hash_payloads: bool = True) -> list[Status]:
        """``hash_payloads=False``: for a caller whose payloads authenticate themselves (an
        :class:`~kvtier.tiers.encrypted.EncryptedTier`'s AES-GCM blocks, whose tags bind the tenant,
        the block's name and its size): each object's header must still name this block at this
        size, but the payload's keyed tag is not checked (its MAC over the payload not computed):
        the caller's own authentication is the check, and what fails it the caller deletes."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        views = [writable_bytes(o) for o in outs]
        digests = [self._digest(k) for k in keys]
        read_for = _first_asked(digests, views)
        deadline = time.monotonic() + self._deadline_in(sum(views[i].nbytes for i in set(read_for)))
        statuses: list[Status | _Rejected] = [Status.ERROR] * len(keys)
        hidden = self._hidden([NAME_PREFIX + d.hex() for d in digests])
        for i in range(len(keys)):
            if hidden[i]:
                statuses[i] = Status.MISS
        with self._removals.reading() as since:
            todo = [i for i in range(len(keys)) if not hidden[i] and read_for[i] == i]
            self._read_in_rounds(todo, digests, views, statuses, deadline, hash_payloads)
            self._read_lost_again(digests, views, statuses, deadline, hash_payloads)
            self._judge_rejected(digests, views, statuses, since, hash_payloads)
        statuses = [Status.MISS if isinstance(s, _SessionLost) else s for s in statuses]
        _serve_repeats(read_for, views, statuses)
        self._count_reads(statuses, views)
        return statuses

    def _read_in_rounds(self, todo: list[int], digests, views, statuses: list, deadline: float,
                        hashed: bool) -> None:
        """Read ``todo`` in rounds that name each block once (the engine reads a name once per batch:
        a key asked at two sizes waits a round). The rounds after the first are follow-ups, made
        only while ``deadline`` leaves time for one: the engine already answered this read, so their
        overrun fails their blocks (ERROR, a miss), not the tier. (Made as first attempts with what
        the first round left, their overrun took a master that answered every call in time for an
        outage: audit s32 a5 D1.)"""
        for r, blocks in enumerate(_rounds(todo, digests)):
            if r and not self._time_left_covers(deadline):
                return  # what is left stays ERROR
            self._read_round(blocks, digests, views, statuses, FollowUp(deadline) if r else deadline, hashed)

    def _read_lost_again(self, digests, views, statuses: list, deadline: float, hashed: bool) -> None:
        """The blocks whose session another read dropped (``_SessionLost``), read once more if the
        read's deadline leaves time for it (a follow-up: its overrun leaves the tier up); what loses
        its session again stays lost (a miss). Read again, a block the tier failed to read is an
        ``ERROR`` (the master down, an overrun)."""
        lost = [i for i, s in enumerate(statuses) if isinstance(s, _SessionLost)]
        if not lost or not self._time_left_covers(deadline):
            return
        for i in lost:
            log.debug("mooncake tier: a read of %s… lost its get session; reading it again", digests[i].hex()[:16])
            statuses[i] = Status.ERROR
        self._read_in_rounds(lost, digests, views, statuses, FollowUp(deadline), hashed)

    def _judge_rejected(self, digests, views, statuses: list, since: int, hashed: bool) -> None:
        """The blocks whose object failed verification (``_Rejected``, see the module's docstring):
        a MISS where a removal of the name by this tier overlapped the read (it tore it: nothing
        to remove, and the name may hold a block put since); the others are read once more, with a
        deadline of their own (the read's may have passed), since another process's removal may
        have torn the first read. What fails again, with no removal of ours beside it, is
        ``CORRUPT`` and removed: all in one call, a follow-up of the re-read (removed one call after
        another, each with a deadline of its own, N tampered blocks cost one get N removals in
        series, N x ``timeout_s`` with removals not answering: audit s33 a3 D1)."""
        again = self._not_torn([i for i, s in enumerate(statuses) if isinstance(s, _Rejected)], digests, statuses,
                               since)
        if not again:
            return
        for i in again:
            log.info("mooncake tier: block %s… rejected: %s; reading it again", digests[i].hex()[:16],
                     statuses[i].why)
            statuses[i] = Status.ERROR
        deadline = time.monotonic() + self._deadline_in(sum(views[i].nbytes + HEADER_NBYTES for i in again))
        self._read_in_rounds(again, digests, views, statuses, deadline, hashed)
        failed_twice = self._not_torn([i for i in again if isinstance(statuses[i], _Rejected)], digests, statuses,
                                      since)
        # (a dict: a key asked twice is removed once)
        self._drop_all({NAME_PREFIX + digests[i].hex(): statuses[i].why for i in failed_twice},
                       self._follow_up_by(deadline))
        for i in failed_twice:
            statuses[i] = Status.CORRUPT

    def _not_torn(self, rejected: list[int], digests, statuses: list, since: int) -> list[int]:
        """Of ``rejected``, those no removal of this tier overlapped; the others are MISSes."""
        left = []
        for i in rejected:
            if self._removals.overlapped(NAME_PREFIX + digests[i].hex(), since):
                log.debug("mooncake tier: read of %s… overlapped its removal: %s", digests[i].hex()[:16],
                          statuses[i].why)
                statuses[i] = Status.MISS
            else:
                left.append(i)
        return left

    def _read_round(self, todo: list[int], digests, views, statuses: list[Status], deadline: float,
                    hashed: bool) -> None:
        """Read ``todo``; what a holder failed is read from other replicas, then tried again (up to
        ``read_attempts`` in all). Those reads are follow-ups
        (:class:`~kvtier.tiers.mooncake_calls.FollowUp`): an overrun of one leaves its blocks ERROR
        and the tier up."""
        by = deadline
        for _ in range(self.read_attempts):
            started = time.monotonic()
            try:
                self._check_up()
                small = [i for i in todo if views[i].nbytes < self._session_min_bytes]
                retry = self._read_pieces(small, digests, views, statuses, by, session=False, hashed=hashed)
                big = [i for i in todo if views[i].nbytes >= self._session_min_bytes]
                if big:
                    retry += self._read_in_session(big, digests, views, statuses, by, hashed)
            except Down:
                break
            # A dead holder answers -800 until the master drops it (its client_ttl), and the engine
            # always reads the first replica: read the others ourselves, at once. What is still
            # unread is tried again; once the master has dropped the holder, a block with no other
            # copy is gone (a miss).
            if retry and self.replicas > 1 and self._transfer is not None:
                try:
                    retry = self._read_other_replicas(retry, digests, views, statuses, FollowUp(deadline), hashed)
                except Down:
                    break
            todo = retry
            # A retry costs what the attempt that failed did (a dead holder's -800 comes at once
            # while its connections close, then after ~1 s a call): made only if the deadline
            # leaves that. Made with less, it overran, and the tier went down (audit s31 a6 D4).
            if not todo or not self._time_left_covers(deadline, time.monotonic() - started):
                break
            by = FollowUp(deadline)

    def _read_in_session(self, todo: list[int], digests, views, statuses: list[Status],
                         deadline: float, hashed: bool) -> list[int]:
        """Read ``todo`` in one get session: the master is asked once for every block's replicas
        (and grants their leases), then the blocks move one per call, the calls running
        together; each is verified as soon as it lands, while the later ones still transfer.
        Returns the indices a holder failed to serve."""
        names = [NAME_PREFIX + digests[i].hex() for i in todo]
        self._client.sessions_opening(names, deadline)
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
                try:
                    end = self._caller.submit(self._engine.batch_get_session_end, ending)
                except BaseException:
                    self._client.sessions_ended(ending)
                    raise
                # reads of these names that start meanwhile wait for it (sessions_opening)
                end.add_done_callback(lambda _, names=ending: self._client.sessions_ended(names))
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
        except Down:
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
        transfer = self._transfer  # read once: the client lets it go as it closes (None then)
        if transfer is None:
            return todo
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
                    statuses[i] = self._judge_resized(name, digests[i], views[i].nbytes, b.size)
                    served = True
                    break
                staged = self._staging.take(n)
                rc = self._call(deadline, transfer.transfer_sync_read, b.transport_endpoint,
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
        read = _ChunkRead(self, chunk, names, sizes, bufs, headers, session)
        # Each payload is MACed on the call's worker as soon as the call returns, while it is
        # still in cache and while the batch's other calls still transfer (on the caller's thread,
        # after the calls that run at once have all ended together, it was a serial tail).
        payloads = ([(digests[i], views[i], headers[1][j * HEADER_NBYTES:(j + 1) * HEADER_NBYTES])
                     if buf is None else (digests[i], buf[1][HEADER_NBYTES:n], buf[1][:HEADER_NBYTES])
                     for j, (i, buf, n) in enumerate(zip(chunk, bufs, sizes))]
                    if hashed else None)
        if session:
            call = (self._engine.batch_get_into_multi_buffer_ranges, names, ptrs, lens, offsets)
        else:
            call = (self._engine.batch_get_into_multi_buffers, names, ptrs, lens)
        read.future = self._caller.submit(read.run_and_tag, payloads, *call)
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
            raise self._overran(exc, deadline) from None  # the engine may still write: the late call gives back
        except Exception as exc:  # noqa: BLE001 - the binding raising is the engine failing
            read.give_back()
            self._failed(f"{type(exc).__name__}: {exc}")
            raise Down(str(exc)) from None
        failed: list[int] = []
        sized: list[tuple[int, str, int]] = []  # (block, name, code): read at another size than asked?
        try:
            self._codes(codes)
            for j, (i, name, buf, n, code) in enumerate(zip(read.chunk, read.names, read.bufs, read.sizes, codes)):
                if code == n:
                    payload_tag = read.tags[j] if read.tags is not None else None
                    if buf is None:
                        row = read.headers[1][j * HEADER_NBYTES:(j + 1) * HEADER_NBYTES]
                        statuses[i] = self._verify_in_place(name, digests[i], row, views[i], hashed, payload_tag)
                    else:
                        statuses[i] = self._verify_into(name, digests[i], buf[1][:n], views[i], hashed,
                                                        payload_tag)
                elif code in (RC_NOT_FOUND, RC_NOT_READY):
                    statuses[i] = Status.MISS  # absent, or still being written by another put
                elif 0 <= code < n or code in (RC_BAD_PARAMS, RC_TRANSFER_FAILED):
                    # a smaller object (a short count; a batch call's -800), one larger than the
                    # buffer (-600), or none of these: a dead holder (-800), a session another
                    # read of the same name dropped under this one (-600)
                    sized.append((i, name, code))
                else:
                    log.info("mooncake tier: read of %s… failed (rc=%d)", name[len(NAME_PREFIX):][:16], code)
                    statuses[i] = Status.ERROR
        finally:
            read.give_back()
        if sized:
            failed += self._judge_sizes(sized, digests, views, statuses, read.session)
        return failed

    def _judge_sizes(self, sized: list[tuple[int, str, int]], digests, views, statuses: list[Status],
                     session: bool) -> list[int]:
        """Reads that failed in a way an object of another size also causes: asks the master the
        objects' sizes (one RPC), judges those of another size (:meth:`_judge_resized`); a session
        read's -600 at the block's size lost its session (``_SessionLost``); the rest are ERRORs,
        and those a holder failed (-800) are returned, to be read again."""
        failed: list[int] = []
        # after a failed read, like _drop: a deadline of its own (the read's may have passed)
        sizes = self._stored_sizes([name for _, name, _ in sized], time.monotonic() + self.timeout_s)
        for i, name, code in sized:
            want = views[i].nbytes + HEADER_NBYTES
            if name not in sizes:
                statuses[i] = Status.MISS  # removed meanwhile, or being written again
            elif sizes[name] not in (None, want):
                statuses[i] = self._judge_resized(name, digests[i], views[i].nbytes, sizes[name])
            elif session and code == RC_BAD_PARAMS and sizes[name] == want:
                statuses[i] = _SessionLost()
            else:
                log.info("mooncake tier: read of %s… failed (rc=%d)", name[len(NAME_PREFIX):][:16], code)
                statuses[i] = Status.ERROR
                if code == RC_TRANSFER_FAILED:
                    failed.append(i)
        return failed

    def _judge_resized(self, name: str, digest: bytes, nbytes: int, size: int) -> Status:
        """The object under ``name`` is ``size`` bytes, not those of a block of ``nbytes``: read it
        whole and check it. This block, whole and tagged, at another size: the caller's buffer is
        wrong (``BAD_SIZE``; kept for callers that ask right). Anything else is not the block
        (a resized forgery, a torn or foreign object): removed, ``CORRUPT`` (a miss, so a store asks
        its next tier, and a put can store the block again). An object larger than a read of this
        block may take to check is removed unchecked (a forger sizes it, not us)."""
        payload = size - HEADER_NBYTES
        if payload <= 0 or self._deadline_in(size) > self._deadline_in(nbytes + HEADER_NBYTES):
            self._drop(name, f"an object of {size} bytes under the name of a block of {nbytes + HEADER_NBYTES}")
            return Status.CORRUPT
        staged = self._staging.take(size)
        deadline = time.monotonic() + self._deadline_in(nbytes + HEADER_NBYTES)
        try:
            codes = self._call(deadline, self._engine.batch_get_into_multi_buffers, [name],
                               [[staged[1].ctypes.data]], [[size]], if_late=lambda: self._staging.give(staged))
        except Late:
            raise  # the late call gives the staging back
        except Down:
            self._staging.give(staged)
            raise
        try:
            if codes[0] in (RC_NOT_FOUND, RC_NOT_READY):
                return Status.MISS
            if codes[0] != size:  # changed again meanwhile, or a holder failure: nothing proven
                return Status.ERROR
            obj = staged[1][:size]
            header = unpack_header(obj[:HEADER_NBYTES])
            if header is not None and names_block(header, digest, payload) and hmac.compare_digest(
                    self.payload_tag(digest, salt_of(header), obj[HEADER_NBYTES:]), header.checksum):
                return Status.BAD_SIZE
        finally:
            self._staging.give(staged)
        self._drop(name, f"an object of {size} bytes under the name of a block of {nbytes + HEADER_NBYTES}, "
                         f"not this block at that size")
        return Status.CORRUPT

    def _header_of(self, name: str, digest: bytes, header_bytes, n: int) -> BlockHeader | Status | _Rejected:
        """An object's header if it names this block at this size in this format; else what the
        read is: the object judged whole if its header names this block at another size (a read
        into a buffer shorter than the object: BAD_SIZE if it is that, else dropped), or rejected
        (:meth:`_judge_rejected`)."""
        header = unpack_header(header_bytes)
        if header is not None and names_block(header, digest, n):
            return header
        if header is not None and names_block(header, digest, header.payload_nbytes):
            size = self._stored_sizes([name], time.monotonic() + self.timeout_s).get(name, -1)
            if size == -1:
                return Status.MISS  # removed meanwhile
            if size not in (None, n + HEADER_NBYTES):
                return self._judge_resized(name, digest, n, size)
            return _Rejected("its header names another size than the object's")
        named = header is not None and header.key[:NAME_ID_BYTES] == digest[:NAME_ID_BYTES]
        return _Rejected("format differs" if named else "header does not name this block")

    @staticmethod
    def _tag_matches(computed: bytes, header: BlockHeader) -> Status | _Rejected:
        if not hmac.compare_digest(computed, header.checksum):
            return _Rejected("payload fails its keyed tag (torn, tampered or not ours)")
        return Status.OK

    def _verify_in_place(self, name: str, digest: bytes, header_bytes: np.ndarray, out: memoryview,
                         hashed: bool = True, payload_tag: bytes | None = None) -> Status | _Rejected:
        """A block received straight into the caller's buffer: MACed where it lies (``payload_tag``:
        already, by the call's worker; not at all if the caller authenticates its payloads: then
        only its header is checked)."""
        header = self._header_of(name, digest, header_bytes, out.nbytes)
        if not isinstance(header, BlockHeader):
            return header
        if not hashed:
            return Status.OK
        if payload_tag is None:
            payload_tag = self.payload_tag(digest, salt_of(header), out)
        return self._tag_matches(payload_tag, header)

    def _verify_into(self, name: str, digest: bytes, staged: np.ndarray, out: memoryview,
                     hashed: bool = True, payload_tag: bytes | None = None) -> Status | _Rejected:
        """A block received into staging: MACed piece by piece while copied out (``payload_tag``:
        computed already, by the call's worker, in staging that nothing writes once the call
        ended; not at all if the caller authenticates its payloads: then only its header is
        checked)."""
        n = out.nbytes
        header = self._header_of(name, digest, staged[:HEADER_NBYTES], n)
        if not isinstance(header, BlockHeader):
            return header
        payload = staged[HEADER_NBYTES:]
        dst = np.frombuffer(out, dtype=np.uint8)
        if not hashed or payload_tag is not None:
            verdict = Status.OK if payload_tag is None else self._tag_matches(payload_tag, header)
            if verdict is Status.OK:
                dst[:] = payload[:n]
            return verdict  # (rejected: nothing copied, the caller's buffer keeps what it held)
        mac = self.payload_mac(digest, n, salt_of(header))
        for start in range(0, n, _COPY_PIECE):  # MAC each piece while in cache, then copy it
            piece = payload[start : start + _COPY_PIECE]
            mac.update(piece)
            dst[start : start + _COPY_PIECE] = piece
        return self._tag_matches(mac.tag(), header)

    def _drop(self, name: str, why: str) -> None:
        """Remove an object that can never verify, with a deadline of its own (see :meth:`_drop_all`)."""
        self._drop_all({name: why}, time.monotonic() + self.timeout_s)

    def _drop_all(self, whys: dict[str, str], deadline: float) -> None:
        """Remove the objects named (each name → why it can never verify) in one engine call, waited
        for until ``deadline`` (forced: a lease protects nothing worth keeping). A removal the call
        does not carry out is owed (hidden, retried), as is every one while the tier is down: then
        the engine is not asked (asked, each drop of a get waited its whole deadline again, the
        tier down after the first: audit s33 a3 D1). One whose call overruns is owed while the call
        runs; once it ends, only what it did not remove stays owed (see ``_remove_by_force``)."""
        if not whys:
            return
        for name, why in whys.items():
            log.warning("mooncake tier: block %s… rejected: %s; removing it", name[len(NAME_PREFIX):][:16], why)
        names = list(whys)
        # (not _check_up: a put that drops what it found under a name has reached the engine, and
        # that check would report it unsent)
        if not self.available:
            self._hide_until_removed(names)
            return
        try:
            codes = self._remove_by_force(names, deadline,
                                          lambda asked_at: self._hide_until_removed(names, since=asked_at))
        except Down:
            return
        self._hide_until_removed(self._not_removed(names, codes))

    def uncount_hits(self, blocks: int, nbytes: int) -> None:
        """Take back ``blocks`` hits of ``nbytes`` in all that this tier counted: for a caller that
        reads them again and has that read counted instead (an EncryptedTier's blocks read unhashed
        that failed its tags). Under the lock the tier counts under (changed under the caller's own
        lock, counts were lost: audit s33 a3 D4)."""
        with self._lock:
            self.stats.hits -= blocks
            self.stats.bytes_read -= nbytes

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


def _first_asked(digests, views) -> list[int]:
    """For each block asked, the first one asked of the same key at the same size: only that one is
    read, and its verdict and bytes serve the others (blocks are content addressed). A key asked
    twice was read in a second round, as a first attempt with what the first round left of the
    deadline: its overrun took the tier down (audit s32 a5 D1)."""
    first: dict[tuple[bytes, int], int] = {}
    return [first.setdefault((d, v.nbytes), i) for i, (d, v) in enumerate(zip(digests, views))]


def _serve_repeats(read_for: list[int], views, statuses: list[Status]) -> None:
    """A repeated block gets the verdict of the read made for it, and its verified bytes."""
    for i, j in enumerate(read_for):
        if j != i:
            statuses[i] = statuses[j]
            if statuses[j] is Status.OK:
                np.frombuffer(views[i], dtype=np.uint8)[:] = np.frombuffer(views[j], dtype=np.uint8)


def _rounds(indices: list[int], digests) -> list[list[int]]:
    """``indices`` in rounds that name each block at most once: the engine reads a name once per
    batch, so a repeated key waits a round."""
    rounds: list[list[int]] = []
    seen: dict[bytes, int] = {}
    for i in indices:
        r = seen[digests[i]] = seen.get(digests[i], -1) + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return rounds


class _ChunkRead:
    """One started engine read: its buffers (registered staging, header rows) are the call's until
    it ends; :meth:`give_back` returns them to the pool exactly once."""

    def __init__(self, tier: MooncakeTier, chunk, names, sizes, bufs, headers, session: bool) -> None:
        self.tier, self.chunk, self.names, self.sizes, self.bufs, self.headers = tier, chunk, names, sizes, bufs, headers
        self.session = session  # a ranged read in an open get session (else a batch call)
        self.nbytes = sum(sizes)
        self.future = None
        #: the MAC of each payload the call read whole, under its header's salt (None: not
        #: computed, not read whole, or its header names no block of this format: verify drops it)
        self.tags: list[bytes | None] | None = None
        self._given = False
        self._lock = threading.Lock()

    def run_and_tag(self, payloads, fn, *args):
        """On the engine call's worker: the call, then the MAC of every payload it read whole."""
        codes = fn(*args)
        if payloads is not None and not isinstance(codes, int):
            self.tags = [self._tag(*p) if code == n else None for p, code, n in zip(payloads, codes, self.sizes)]
        return codes

    def _tag(self, digest: bytes, payload, header_row) -> bytes | None:
        header = unpack_header(header_row)
        if header is None or not names_block(header, digest, payload.nbytes):
            return None
        return self.tier.payload_tag(digest, salt_of(header), payload)

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
