"""Whole-file digests of model weight files, hashed once and remembered across restarts.

A namespace that identifies weights by a *sample* of their bytes gives a partial
fine-tune the base model's identity, and with it the base model's KV: wrong
outputs. So every byte is hashed, with SHA-256 (the standard library's, with
the CPU's SHA extensions through OpenSSL; blake3 is not a dependency). A file's
digest is a two-level hash: SHA-256 over its size and the SHA-256 of each
64 MiB chunk, so that the chunks of even a single-file model are hashed on all
cores at once (hashlib releases the GIL), and reads are large. That still costs
seconds for a large model (see README, "Hugging Face transformers"), so each
file's digest is kept in a small cache file,
``$XDG_CACHE_HOME/kvtier/weights-sha256.json``, under the file's identity on
this machine: real path, device, inode, size, mtime and ctime (ns). Any write
to a file changes its ctime (which no user call can set back), so a changed
file is hashed again; an unchanged one is not even opened after a restart.

The cache file is written atomically (temporary file, fsync, rename) with mode
0600, and is ignored unless it is this user's and writable by nobody else: a
forged entry could give a fine-tune its base model's identity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

HASH_NAME = "sha256"
#: a file is hashed as chunks of this size, in parallel, then the chunk digests hashed in order
CHUNK_BYTES = 64 << 20
#: bytes read (and hashed) at a time: large enough that the per-call cost vanishes
READ_BYTES = 8 << 20
#: chunks hashed at once (hashlib releases the GIL while it hashes)
HASH_THREADS = min(8, os.cpu_count() or 1)
#: entries kept in the cache file (the oldest go first)
MAX_ENTRIES = 4096
_FORMAT = 1


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / f"weights-{HASH_NAME}.json"


def file_stamp(path: str | os.PathLike) -> dict:
    """What identifies a file's content on this machine without reading it."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return {"path": real, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


_buffers = threading.local()


def _hash_chunk(fd: int, offset: int, nbytes: int) -> bytes:
    """SHA-256 of ``nbytes`` at ``offset``, read in large pieces into this thread's buffer."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    h = hashlib.new(HASH_NAME)
    end = offset + nbytes
    while offset < end:
        n = os.preadv(fd, [view[: min(READ_BYTES, end - offset)]], offset)
        if n == 0:
            raise ConfigError(f"weights file shrank while it was being hashed (at byte {offset})")
        h.update(view[:n])
        offset += n
    return h.digest()


def hash_file(path: str | os.PathLike, pool: ThreadPoolExecutor | None = None) -> str:
    """The file's digest: SHA-256 over its size and the SHA-256 of each :data:`CHUNK_BYTES` chunk
    (chunks hashed on ``pool`` if given)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        spans = [(off, min(CHUNK_BYTES, size - off)) for off in range(0, size, CHUNK_BYTES)]
        if pool is None:
            chunks = [_hash_chunk(fd, off, n) for off, n in spans]
        else:
            chunks = list(pool.map(lambda span: _hash_chunk(fd, *span), spans))
    finally:
        os.close(fd)
    top = hashlib.new(HASH_NAME)
    top.update(size.to_bytes(8, "little"))
    for digest in chunks:
        top.update(digest)
    return top.hexdigest()


class WeightsDigests:
    """Digests of weight files, from the cache file when a file is unchanged, else hashed (and cached).

    ``cache_path=None`` is :func:`default_cache_path`; ``False`` keeps nothing on disk.
    :attr:`files_hashed` / :attr:`bytes_hashed` count what this object actually read.
    """

    def __init__(self, cache_path: str | os.PathLike | None | bool = None, *, threads: int = HASH_THREADS) -> None:
        if cache_path is None or cache_path is True:
            cache_path = default_cache_path()
        self.cache_path = Path(cache_path) if cache_path is not False else None
        self.threads = max(1, threads)
        self.files_hashed = 0
        self.bytes_hashed = 0

    def digests(self, paths: list[str | os.PathLike], *, check=None) -> list[str]:
        """One hex digest per path, in order. ``check(path)`` runs before a file is hashed (it may
        raise); a file whose digest is cached is not opened at all."""
        stamps = [file_stamp(p) for p in paths]
        entries = self._load()
        out: list[str | None] = []
        for stamp in stamps:
            entry = entries.get(stamp["path"])
            out.append(entry["digest"] if entry is not None and _same(entry, stamp) else None)
        todo = [i for i, d in enumerate(out) if d is None]
        if not todo:
            return out  # type: ignore[return-value]
        total = sum(stamps[i]["size"] for i in todo)
        log.info("hashing %d weight file(s), %.2f GB, once (cached in %s)", len(todo), total / 1e9, self.cache_path)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="kvtier-weights") as pool:
            for i in todo:  # one file at a time, its chunks on every thread
                out[i] = self._hash(stamps[i], check, pool)
        log.info("hashed %.2f GB of weights in %.1f s", total / 1e9, time.perf_counter() - t0)
        self._store({stamps[i]["path"]: {**stamps[i], "digest": out[i], "at": time.time()} for i in todo})
        return out  # type: ignore[return-value]

    def _hash(self, stamp: dict, check, pool: ThreadPoolExecutor) -> str:
        if check is not None:
            check(stamp["path"])
        digest = hash_file(stamp["path"], pool)
        if not _same(file_stamp(stamp["path"]), stamp):
            raise ConfigError(f"{stamp['path']} changed while it was being hashed; load the model once it is written")
        self.files_hashed += 1
        self.bytes_hashed += stamp["size"]
        return digest

    # -- the cache file ----------------------------------------------------------------------
    def _load(self) -> dict[str, dict]:
        path = self.cache_path
        if path is None:
            return {}
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("weights digest cache %s unreadable (%s): hashing afresh", path, exc)
            return {}
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                log.warning("weights digest cache %s is not this user's alone: ignored", path)
                return {}
            try:
                doc = json.loads(f.read())
            except ValueError:
                log.warning("weights digest cache %s is not JSON: ignored", path)
                return {}
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("hash") != HASH_NAME:
            return {}
        entries = doc.get("entries")
        return entries if isinstance(entries, dict) else {}

    def _store(self, new: dict[str, dict]) -> None:
        """Merge ``new`` into the cache file (re-read first: other processes write it too)."""
        path = self.cache_path
        if path is None:
            return
        entries = {**self._load(), **new}
        if len(entries) > MAX_ENTRIES:
            keep = sorted(entries, key=lambda p: entries[p].get("at", 0), reverse=True)[:MAX_ENTRIES]
            entries = {p: entries[p] for p in keep}
        body = json.dumps({"format": _FORMAT, "hash": HASH_NAME, "entries": entries}, sort_keys=True).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:  # a cache: the identity stands without it, the next start rehashes
            log.warning("could not write the weights digest cache %s: %s", path, exc)


def _same(entry: dict, stamp: dict) -> bool:
    return all(entry.get(k) == v for k, v in stamp.items())
