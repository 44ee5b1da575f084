"""``kvtier bench storage``: tier put/get throughput as a ratio of the hardware limit.

The limit is measured in the same run, on the same block sizes and the same
buffers, interleaved with the tier block by block (who goes first alternates)
so that the noise of a shared machine hits both:

* ``host``: ``numpy.copyto`` into / out of a warm buffer as large as the tier's
  pool and of the same kind: an anonymous mmap with transparent huge pages,
  prefaulted (:func:`~kvtier.bench.baselines.huge_page_buffer`). With 4 KiB
  pages the baseline paid TLB misses the pool does not, worth 3-18 %: the
  reason ratios above 1.0 were posted before.
* ``disk``: a new file per block, in the same directory as the tier's file of
  that block, written with O_DIRECT ``pwrite`` + ``fsync``; cold ``preadv``
  (O_DIRECT, cache dropped with ``posix_fadvise(DONTNEED)``). Tier puts are
  durable (fsync'd) and tier gets cold, like the limit's. A block the tier reads
  in pieces (:func:`~kvtier.tiers.direct_io.read_pieces`, one request in flight,
  hashing behind them) is also read raw in the same pieces (its own copy of the
  file); the get limit of a run is the faster of the two raw reads (one ``preadv``
  of the whole file, or the tier's pieces), so that neither way of reading
  flatters the tier.

* ``disk --encrypt``: the sealed tier (chunked AES-256-GCM, streamed in 2 MiB
  chunks with the next chunk sealed / opened on a helper while one is written /
  read) against two baselines of the same run: the raw O_DIRECT limit with the
  same I/O (2 MiB requests, one in flight, ``fsync``; cold reads) from and into
  the same kind of memory as the tier's staging (huge pages,
  :func:`~kvtier.tiers.direct_io.io_buffer`: into 4 KiB pages a request is a
  device segment per page, a slower limit than the tier's own I/O), and plain
  data through the same streamed path (the disk tier's ``put_streams`` /
  ``get_streams`` with a source and sink that only copy), so that
  ``encrypt_*_ratio`` isolates the cipher's cost and ``put_ratio`` /
  ``get_ratio`` say how far the whole is from the device.

``--dir`` and ``--drop-caches`` are for the disk tier: with ``--tier host`` they are refused.

Throughputs are medians over runs in GB/s (1e9 bytes); each ratio is the
median of the per-run ratios tier / limit (paired, so slow phases of the
machine cancel). A ratio above 1.05 against a limit comes with a line in
``warnings`` (and on stderr): the baseline is wrong, not kvtier fast.

Every get, the tier's and the limit's alike, lands in a buffer poisoned just
before it (outside the timing) and is compared with what was put just after it
(also outside): a get that reports success without writing, or writes the wrong
bytes, stops the benchmark with an error instead of posting a fast figure.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from kvtier.bench.baselines import huge_page_buffer, ratio_warnings, report_warnings
from kvtier.core.units import finite_float
from kvtier.errors import ConfigError
from kvtier.tiers.direct_io import (
    CHUNK,
    PAGE,
    PIECED_MIN,
    aligned_buffer,
    drop_cache,
    io_buffer,
    pwrite_all,
    read_pieces,
    round_up,
)

MIB = 1 << 20
#: default bytes moved per phase of a run: long enough to average out per-op noise
DEFAULT_RUN_BYTES = 256 * MIB


TIER, LIMIT = 0, 1
#: the byte every get buffer holds before the get; a get must overwrite it with the block
POISON = 0xA5


def _phase(ops: list[Callable[[int, bytes], None]], keys: list[bytes], first: int,
           before: Callable[[int], None] | None = None,
           after: Callable[[int, int], None] | None = None) -> list[float]:
    """Seconds spent in each side (``ops[0]`` the tier, the others its baselines) over all
    blocks, interleaved block by block with who goes first rotating, so that a slow
    moment of the machine hits every side. ``before(i)`` and ``after(i, who)`` run
    around each operation, untimed."""
    spent = [0.0] * len(ops)
    for i, key in enumerate(keys):
        shift = (i + first) % len(ops)
        for who in list(range(len(ops)))[shift:] + list(range(len(ops)))[:shift]:
            if before is not None:
                before(i)
            t0 = time.perf_counter()
            ops[who](i, key)
            spent[who] += time.perf_counter() - t0
            if after is not None:
                after(i, who)
    return spent


def _poison(out: np.ndarray) -> None:
    out.fill(POISON)


def _verify(got: np.ndarray, want: np.ndarray, who: int, i: int, sides: tuple[str, ...] = ("tier", "limit")) -> None:
    if not np.array_equal(got, want):
        side = sides[who]
        untouched = bool(np.all(got == POISON))
        raise RuntimeError(
            f"{side} get of block {i} reported success but the buffer "
            + ("was never written (still poisoned)" if untouched else "holds other bytes than were put")
        )


def refuse_beyond_memory(sizes: str, needed: int) -> None:
    """Refuse (ConfigError) a run whose buffers need more bytes than this host's physical memory:
    a size typed a few digits too long ended in a MemoryError traceback, or in swapping for hours.
    ``sizes``: the flags that set ``needed``, as the message quotes them."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        raise ConfigError(f"{sizes} needs at least {needed / 2**30:.1f} GiB of memory, this host has "
                          f"{memory / 2**30:.1f} GiB")


def refuse_beyond_free_space(sizes: str, needed: int, directory: str) -> None:
    """Refuse (ConfigError) a run whose files need more bytes than ``directory``'s file system has
    free, before it writes them: it would end in ENOSPC, after filling the disk for others."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise ConfigError(f"{sizes} needs at least {needed / 2**30:.1f} GiB of disk in {directory}, it has "
                          f"{free / 2**30:.1f} GiB free")


def _keys(run: int, blocks: int) -> list[bytes]:
    return [hashlib.sha256(f"bench-storage/{run}/{i}".encode()).digest() for i in range(blocks)]


def _filled(nbytes: int, seed: int) -> np.ndarray:
    buf = aligned_buffer(round_up(nbytes))  # whole pages, so that O_DIRECT can move it
    buf[:nbytes] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def _check(status, what: str) -> None:
    if not status.ok:
        raise RuntimeError(f"{what} failed with {status.name}; is the directory full or the tier too small?")


class _HostBench:
    SIDES = ("tier", "limit")

    def put_ops(self):
        return [self.tier_put, lambda i, key: self.limit_put(i)]

    def get_ops(self):
        return [self.tier_get, lambda i, key: self.limit_get(i)]

    def __init__(self, nbytes: int, blocks: int) -> None:
        from kvtier.tiers.host import HostTier

        self.n, self.blocks = nbytes, blocks
        self.tier = HostTier(blocks * round_up(nbytes), nbytes)
        self.srcs = [_filled(nbytes, s)[:nbytes] for s in (1, 2)]
        self.outs = [aligned_buffer(nbytes) for _ in range(2)]
        # Faulted in, as big as the pool and the same kind of memory (huge pages,
        # prefaulted, like HostTier's pool): the limit is the copy, not the page size.
        self.warm = huge_page_buffer(blocks * nbytes).reshape(blocks, nbytes)

    def tier_put(self, i: int, key: bytes) -> None:
        _check(self.tier.put(key, self.srcs[i % 2]), "host put")

    def limit_put(self, i: int) -> None:
        np.copyto(self.warm[i], self.srcs[i % 2])

    def tier_get(self, i: int, key: bytes) -> None:
        _check(self.tier.get(key, self.outs[i % 2]), "host get")

    def limit_get(self, i: int) -> None:
        np.copyto(self.outs[i % 2], self.warm[i])

    def poison_get(self, i: int) -> None:
        _poison(self.outs[i % 2])

    def verify_get(self, i: int, who: int) -> None:
        _verify(self.outs[i % 2], self.srcs[i % 2], who, i)

    def start(self, keys):
        pass

    def between(self, keys):
        pass

    def cleanup(self, keys):
        for k in keys:
            self.tier.delete(k)

    def close(self):
        self.tier.close()

    def describe(self) -> dict:
        return {}


class _DiskBench:
    SIDES = ("tier", "limit")
    put_ops = _HostBench.put_ops

    def get_ops(self):
        ops = _HostBench.get_ops(self)
        if self.pieced:  # the tier's own requests, read raw: a second limit
            ops.append(lambda i, key: self.limit_get_pieced(i))
        return ops

    def limit_get_pieced(self, i: int) -> None:
        """The raw file read in the pieces a tier get of this size reads, one after the other
        (the raw file has no header page: the first request is a page shorter than the tier's)."""
        out = self.padded[2 + i % 2]
        fd = os.open(self._raw_pieced(i), os.O_RDONLY | self._flags())
        try:
            for off, length in self.pieces:
                want = round_up(length)
                if os.preadv(fd, [out[off : off + want]], off) != want:
                    raise RuntimeError(f"short read of {self._raw_pieced(i)}")
        finally:
            os.close(fd)

    def __init__(self, nbytes: int, blocks: int, directory: str | None, drop_caches: bool) -> None:
        from kvtier.tiers.disk import DiskTier

        self.n, self.blocks = nbytes, blocks
        # A directory of this run's own, inside --dir when given, removed on close: a run left
        # --dir's tier/, sealed/ and keys/ behind, and the next run's key store, bound to that
        # run's random master key, refused the one left there.
        self.dir = tempfile.mkdtemp(prefix=".kvtier-bench-", dir=directory or os.getcwd())
        self.tier = DiskTier(os.path.join(self.dir, "tier"), 2 * blocks * (round_up(nbytes) + PAGE))
        self.raw_paths: list[str] = []
        self.direct = self.tier.direct_io
        self.drop_caches = drop_caches
        # O_DIRECT needs whole pages: the limit moves the payload rounded up to a page.
        self.padded = [_filled(nbytes, s) for s in (1, 2)] + [aligned_buffer(round_up(nbytes)) for _ in range(2)]
        self.srcs = [b[:nbytes] for b in self.padded[:2]]
        self.outs = [b[:nbytes] for b in self.padded[2:]]
        # The tier reads large blocks in pieces, one request in flight, hashing behind.
        self.pieced = nbytes >= PIECED_MIN
        self.pieces = read_pieces(nbytes)

    def _raw(self, i: int) -> str:
        return self.raw_paths[i]

    def _raw_pieced(self, i: int) -> str:
        # Its own copy of the block: a file just read by the other limit could come back
        # faster from a cache below the guest (a virtual disk's host), flattering neither side.
        return self.raw_paths[i] + "p"

    def _write_pieced_copies(self, count: int) -> None:
        """The pieced limit's files, written untimed (the put limit is the one-file write)."""
        for i in range(count):
            self._write_raw(self._raw_pieced(i), self.padded[i % 2])

    def start(self, keys):
        # The limit's files sit next to the tier's, in the same shard directories,
        # so that both write to the same places of the file system.
        self.raw_paths = [self.tier.path_of(k) + ".raw" for k in keys]

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def tier_put(self, i: int, key: bytes) -> None:
        _check(self.tier.put(key, self.srcs[i % 2]), "disk put")

    def limit_put(self, i: int) -> None:
        self._write_raw(self._raw(i), self.padded[i % 2])

    def _write_raw(self, path: str, data) -> None:
        """What a put costs at the limit: one write of the padded block, then fsync."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o644)
        try:
            pwrite_all(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def tier_get(self, i: int, key: bytes) -> None:
        _check(self.tier.get(key, self.outs[i % 2]), "disk get")

    def limit_get(self, i: int) -> None:
        fd = os.open(self._raw(i), os.O_RDONLY | self._flags())
        try:
            if os.preadv(fd, [self.padded[2 + i % 2]], 0) != self.padded[2].nbytes:
                raise RuntimeError(f"short read of {self._raw(i)}")
        finally:
            os.close(fd)

    def poison_get(self, i: int) -> None:
        _poison(self.padded[2 + i % 2])  # the limit reads whole pages into it; the tier its first n bytes

    def verify_get(self, i: int, who: int) -> None:
        _verify(self.outs[i % 2], self.srcs[i % 2], who, i, ("tier", "limit", "limit_pieces"))

    def between(self, keys):
        """Make the gets cold (not timed)."""
        paths = [self.tier.path_of(k) for k in keys] + [self._raw(i) for i in range(len(keys))]
        if self.pieced:
            self._write_pieced_copies(len(keys))
            paths += [self._raw_pieced(i) for i in range(len(keys))]
        self._make_cold(paths)

    def _make_cold(self, paths: list[str]) -> None:
        """Forget every file's cached pages; with ``--drop-caches``, the machine's whole page cache too."""
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                drop_cache(fd)
            finally:
                os.close(fd)
        if self.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")

    def cleanup(self, keys):
        for k in keys:
            self.tier.delete(k)
        for i in range(len(keys)):
            os.unlink(self._raw(i))
            if self.pieced:
                os.unlink(self._raw_pieced(i))

    def close(self):
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def describe(self) -> dict:
        return {"direct_io": self.direct, "dir": self.dir}


class _PlainSource:
    """Plain bytes as a streamed payload (a ``PayloadSource`` that only hands out slices)."""

    def __init__(self, data: np.ndarray, chunk: int) -> None:
        self.data, self.chunk, self.nbytes = data, chunk, data.nbytes

    def pieces(self):
        for off in range(0, self.nbytes, self.chunk):
            yield memoryview(self.data[off : off + self.chunk])


class _PlainSink:
    """A ``PayloadSink`` that takes a streamed payload into a buffer and judges nothing."""

    def __init__(self, out: np.ndarray, chunk: int) -> None:
        self.out, self.chunk, self.nbytes = out, chunk, out.nbytes

    def pieces(self):
        for off in range(0, self.nbytes, self.chunk):
            yield memoryview(self.out[off : off + self.chunk])
        return None


class _EncryptedDiskBench(_DiskBench):
    """The sealed disk tier against plain data through the same streamed path and the raw limit.

    Three sides per block, in sibling directories of one file system: the
    :class:`~kvtier.tiers.encrypted.EncryptedTier` over a disk tier (sealed chunk
    by chunk, streamed); the plain disk tier moving the same bytes through its
    streams (same staging, chunking and helper thread, no cipher); raw O_DIRECT
    files written and read in the same 2 MiB requests, one in flight, from and into
    buffers of their own of the same memory kind as the tier's staging.
    """

    SIDES = ("sealed", "plain_stream", "limit")
    LIMIT = 2  #: the raw limit's side

    def __init__(self, nbytes: int, blocks: int, directory: str | None, drop_caches: bool) -> None:
        super().__init__(nbytes, blocks, directory, drop_caches)
        self.pieced = False  # its raw limit reads in the streamed path's 2 MiB requests instead
        self.chunk = CHUNK  # the disk tier's staging chunk (BlockIO's default), in both baselines
        # The tier's O_DIRECT requests leave from and land in its staging (io_buffer: huge pages
        # where the kernel gives them); the limit's do the same. At least the staging's two chunks,
        # so that a block smaller than a huge page gets one too, as the staging does.
        self.limit_bufs = [self._like_staging(b) for b in self.padded]  # srcs (copies), then outs
        from kvtier.crypto.keyring import Keyring
        from kvtier.crypto.providers import StaticMasterKey
        from kvtier.tiers.disk import DiskTier
        from kvtier.tiers.encrypted import EncryptedTier

        keyring = Keyring(StaticMasterKey(os.urandom(32)), os.path.join(self.dir, "keys"))
        inner = DiskTier(os.path.join(self.dir, "sealed"), 2 * blocks * (round_up(nbytes) + 2 * PAGE + nbytes // 1000))
        self.sealed = EncryptedTier(inner, keyring, "bench")

    def _like_staging(self, data: np.ndarray) -> np.ndarray:
        buf = io_buffer(max(data.nbytes, 2 * self.chunk))[: data.nbytes]
        np.copyto(buf, data)
        return buf

    def put_ops(self):
        return [self.sealed_put, self.stream_put, lambda i, key: self.limit_put(i)]

    def get_ops(self):
        return [self.sealed_get, self.stream_get, lambda i, key: self.limit_get(i)]

    def sealed_put(self, i: int, key: bytes) -> None:
        _check(self.sealed.put(key, self.srcs[i % 2]), "encrypted disk put")

    def stream_put(self, i: int, key: bytes) -> None:
        _check(self.tier.put_streams([key], [_PlainSource(self.srcs[i % 2], self.chunk)])[0], "plain streamed put")

    def limit_put(self, i: int) -> None:
        fd = os.open(self._raw(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        try:
            src = self.limit_bufs[i % 2]
            for off in range(0, src.nbytes, self.chunk):
                pwrite_all(fd, src[off : off + self.chunk], off)
            os.fsync(fd)
        finally:
            os.close(fd)

    def sealed_get(self, i: int, key: bytes) -> None:
        _check(self.sealed.get(key, self.outs[i % 2]), "encrypted disk get")

    def stream_get(self, i: int, key: bytes) -> None:
        _check(self.tier.get_streams([key], [_PlainSink(self.outs[i % 2], self.chunk)])[0], "plain streamed get")

    def limit_get(self, i: int) -> None:
        fd = os.open(self._raw(i), os.O_RDONLY | self._flags())
        try:
            out = self.limit_bufs[2 + i % 2]
            for off in range(0, out.nbytes, self.chunk):
                want = min(self.chunk, out.nbytes - off)
                if os.preadv(fd, [out[off : off + want]], off) != want:
                    raise RuntimeError(f"short read of {self._raw(i)}")
        finally:
            os.close(fd)

    def poison_get(self, i: int) -> None:
        _poison(self.padded[2 + i % 2])
        _poison(self.limit_bufs[2 + i % 2])

    def verify_get(self, i: int, who: int) -> None:
        got = self.limit_bufs[2 + i % 2][: self.n] if who == self.LIMIT else self.outs[i % 2]
        _verify(got, self.srcs[i % 2], who, i, self.SIDES)

    def between(self, keys):
        paths = [self.tier.path_of(k) for k in keys] + [self._raw(i) for i in range(len(keys))]
        paths += [self.sealed.inner.path_of(self.sealed.storage_name(k)) for k in keys]
        self._make_cold(paths)

    def cleanup(self, keys):
        super().cleanup(keys)
        for k in keys:
            self.sealed.delete(k)

    def close(self):
        self.sealed.close()
        super().close()


def run(tier: str, block_mib: float, blocks: int | None, runs: int, directory: str | None = None,
        drop_caches: bool = False, encrypt: bool = False) -> dict:
    """Measure ``runs`` interleaved rounds; return the medians (see the module docstring)."""
    if not math.isfinite(block_mib) or block_mib * MIB < 1 or runs <= 0:
        raise ConfigError(f"--block-mib and --runs must be positive, got {block_mib} and {runs}")
    nbytes = int(block_mib * MIB)
    if blocks is not None and blocks < 1:
        raise ConfigError(f"--blocks must be positive, got {blocks}")
    if directory is not None and not os.path.isdir(directory):
        raise ConfigError(f"--dir {directory!r} is not a directory")
    if encrypt and tier != "disk":
        raise ConfigError("--encrypt applies to --tier disk (the host tier stays plaintext by default)")
    blocks = blocks or max(4, -(-DEFAULT_RUN_BYTES // nbytes))
    _refuse_beyond_the_host(tier, nbytes, blocks, directory, encrypt)
    if encrypt:
        bench = _EncryptedDiskBench(nbytes, blocks, directory, drop_caches)
    elif tier == "host":
        bench = _HostBench(nbytes, blocks)
    else:
        bench = _DiskBench(nbytes, blocks, directory, drop_caches)
    total = nbytes * blocks
    sides = len(bench.SIDES)
    pieced = isinstance(bench, _DiskBench) and not encrypt and bench.pieced
    put = [[] for _ in range(sides)]  # GB/s per run, per side
    get = [[] for _ in range(sides + pieced)]  # plain disk, pieced: [tier, one preadv, raw pieces]
    try:
        for r in range(-1, runs):  # run -1 warms up code paths and the file system; not counted
            keys = _keys(r, blocks)
            bench.start(keys)
            put_s = _phase(bench.put_ops(), keys, r)
            bench.between(keys)
            get_s = _phase(bench.get_ops(), keys, r, bench.poison_get, bench.verify_get)
            bench.cleanup(keys)
            if r >= 0:
                for side in range(sides):
                    put[side].append(total / put_s[side] / 1e9)
                for side in range(len(get)):
                    get[side].append(total / get_s[side] / 1e9)
    finally:
        bench.close()
    med = statistics.median

    def ratio(runs_a, runs_b) -> float:
        return round(med(a / b for a, b in zip(runs_a, runs_b)), 3)

    limit = sides - 1  # the last side is the hardware limit
    raw_one = get[limit]
    if pieced:  # the get limit of each run: the faster raw way to read the block
        get[limit] = [max(one, pieces) for one, pieces in zip(get[limit], get[limit + 1])]
    common = {"block_mib": block_mib, "blocks": blocks, "runs": runs,
              "put_gbps": round(med(put[0]), 3), "get_gbps": round(med(get[0]), 3),
              "limit_put_gbps": round(med(put[limit]), 3), "limit_get_gbps": round(med(get[limit]), 3),
              "put_ratio": ratio(put[0], put[limit]), "get_ratio": ratio(get[0], get[limit])}
    if encrypt:
        result = {
            "tier": "disk", "encrypt": True, **common,
            "plain_stream_put_gbps": round(med(put[1]), 3),
            "plain_stream_get_gbps": round(med(get[1]), 3),
            "plain_stream_put_ratio": ratio(put[1], put[limit]),
            "plain_stream_get_ratio": ratio(get[1], get[limit]),
            # sealed / plain through the same streamed path: the cipher's cost alone
            "encrypt_put_ratio": ratio(put[0], put[1]),
            "encrypt_get_ratio": ratio(get[0], get[1]),
            "chunk_mib": bench.chunk / MIB,
            **bench.describe(),
        }
        result["encrypt_ratio"] = min(result["encrypt_put_ratio"], result["encrypt_get_ratio"])
        checked = {k: result[k] for k in ("put_ratio", "get_ratio", "plain_stream_put_ratio",
                                          "plain_stream_get_ratio", "encrypt_put_ratio", "encrypt_get_ratio")}
    else:
        result = {"tier": tier, **common, **bench.describe()}
        checked = {k: result[k] for k in ("put_ratio", "get_ratio")}
        if pieced:
            result.update(limit_get_one_read_gbps=round(med(raw_one), 3),
                          limit_get_pieces_gbps=round(med(get[limit + 1]), 3),
                          get_ratio_vs_one_read=ratio(get[0], raw_one),
                          get_ratio_vs_pieces=ratio(get[0], get[limit + 1]),
                          piece_mib=[round(n / MIB, 3) for _, n in bench.pieces])
            checked.update(get_ratio_vs_one_read=result["get_ratio_vs_one_read"],
                           get_ratio_vs_pieces=result["get_ratio_vs_pieces"])
    result["warnings"] = ratio_warnings(checked)
    return result


def _refuse_beyond_the_host(tier: str, nbytes: int, blocks: int, directory: str | None, encrypt: bool) -> None:
    """The bytes a run holds at once, against the host's memory and the disk's free space (lower
    bounds): the host bench keeps every block twice (the tier's pool, the limit's warm buffer),
    the disk bench every block in a file of the tier's and one of the limit's (and the sealed
    tier's); both keep four block buffers (the sealed bench eight: its staging-like copies)."""
    sizes = f"--block-mib {nbytes / MIB:g} x --blocks {blocks}"
    if tier == "host":
        refuse_beyond_memory(sizes, (2 * blocks + 4) * nbytes)
        return
    refuse_beyond_memory(f"--block-mib {nbytes / MIB:g}", (8 if encrypt else 4) * nbytes)
    refuse_beyond_free_space(sizes, (3 if encrypt else 2) * blocks * nbytes, directory or os.getcwd())


def register(subparsers) -> None:
    p = subparsers.add_parser("storage", help="tier put/get throughput vs memcpy / raw disk, same run")
    p.add_argument("--tier", choices=["host", "disk"], default="disk")
    p.add_argument("--block-mib", type=finite_float, default=8.0, help="block size in MiB (default 8)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per phase (default: 256 MiB worth, at least 4)")
    p.add_argument("--runs", type=int, default=9, help="interleaved rounds; medians are reported (default 9)")
    p.add_argument("--dir", default=None,
                   help="where the disk tier's files go: a temp dir of the run's own inside it, removed after "
                        "(default: the current directory)")
    p.add_argument("--drop-caches", action="store_true",
                   help="also write /proc/sys/vm/drop_caches before gets (root; affects the whole machine)")
    p.add_argument("--encrypt", action="store_true",
                   help="disk only: sealed tier vs plain data through the same streamed path "
                        "(encrypt_ratio) and vs raw O_DIRECT with the same 2 MiB requests (put/get_ratio)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _refuse_disk_flags_for_host(args) -> None:
    """``--dir`` and ``--drop-caches`` say where and how cold the disk tier's files are; the host
    bench has no files, and would run without them."""
    given = [flag for flag, is_given in (("--dir", args.dir is not None), ("--drop-caches", args.drop_caches))
             if is_given]
    if args.tier == "host" and given:
        one = len(given) == 1
        raise ConfigError(f"{' and '.join(given)} {'is' if one else 'are'} for --tier disk: the host tier keeps "
                          f"no files; leave {'it' if one else 'them'} out or measure --tier disk")


def _main(args) -> int:
    _refuse_disk_flags_for_host(args)
    result = run(args.tier, args.block_mib, args.blocks, args.runs, args.dir, args.drop_caches, args.encrypt)
    report_warnings(result["warnings"])
    if args.json or args.encrypt:
        print(json.dumps(result, allow_nan=False))  # NaN or Infinity is no JSON: fail here, not in a reader
        return 0
    from rich.console import Console
    from rich.table import Table

    limit = "numpy.copyto, warm huge pages" if args.tier == "host" else "O_DIRECT pwrite+fsync / cold preadv"
    table = Table(title=f"{args.tier} tier, {result['blocks']} x {args.block_mib:g} MiB blocks "
                        f"(median of {args.runs} runs)")
    for col in ("", "tier GB/s", f"limit GB/s ({limit})", "ratio"):
        table.add_column(col, justify="right")
    for op in ("put", "get"):
        table.add_row(op, f"{result[op + '_gbps']:.2f}", f"{result['limit_' + op + '_gbps']:.2f}",
                      f"{result[op + '_ratio']:.2f}")
    Console().print(table)
    return 0
