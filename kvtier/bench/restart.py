"""``kvtier bench restart``: what survives a graceful shutdown, read back by a new process.

Two sections in one run (``--no-server`` skips the second):

* **embedded**: a ``TieredStore([HostTier, DiskTier])`` in a temporary
  directory (default write mode) takes ``--blocks`` chained blocks of random
  bytes that fit both tiers -- the host evicts nothing, so before ``close`` the
  disk holds only what write-behind copied -- then ``close()`` (timed). A *new
  process* opens a ``DiskTier`` alone on the same directory and gets every
  block into a buffer poisoned beforehand (0xA5), comparing the SHA-256 of what
  it read with the digests the parent passes on stdin (JSON; nothing is
  pickled across the boundary).
* **server**: a ``kvtier serve`` with ``disk_dir`` takes the same number of
  blocks through a ``RemoteTier``, is stopped with SIGTERM, started again on
  the same ``disk_dir``, and every block is read back the same way.

JSON keys (``--json``; all flat):

``blocks``, ``block_bytes``
    blocks per section and their size.
``put_s``
    seconds the embedded ``put`` of every block took (the engine's side).
``close_flush_s``
    seconds ``TieredStore.close()`` took: the flush of what was still dirty,
    then closing the tiers.
``flushed``, ``dropped``
    the close's :class:`~kvtier.store.tiered.FlushReport`: copies made, dirty
    blocks left behind.
``recovered_ratio``
    blocks the new process read back with the right bytes ÷ ``blocks``.
``recovered_blocks``, ``wrong_blocks``
    the count behind the ratio, and blocks returned OK with other bytes (must
    be 0: a cache may lose, never return a wrong block).
``verify_s``
    seconds the new process took to open the directory and read everything.
``server_put_ok``
    blocks the server accepted.
``server_stop_s``
    seconds from SIGTERM to the server's exit (its own flush included).
``server_recovered_ratio``, ``server_recovered_blocks``, ``server_wrong_blocks``
    as above, read from the restarted server.
``server_error``
    present only when the server section could not run (e.g. the server extras
    are not installed); its other keys are then absent.

The exit status is 1, after the figures, when a block came back with wrong bytes or the
server section did not run (without ``--no-server``): a script or CI reads a failed run as one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvtier.errors import ConfigError
from kvtier.json_files import strict_json

KIB = 1 << 10
MIB = 1 << 20
POISON = 0xA5
_NAMESPACE = "bench-restart"


def _chained_keys(n: int, seed: bytes) -> list[bytes]:
    """Chained 32-byte keys, as block keys are: each one hashes the one before."""
    keys, prev = [], hashlib.sha256(b"kvtier bench restart root" + seed).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        keys.append(prev)
    return keys


def _payloads(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def _digest(buf) -> str:
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()


def _judge(digests: list[str | None], expected: list[str]) -> tuple[int, int]:
    """(verified, wrong): blocks read with the expected bytes, and OK reads with other bytes."""
    verified = sum(got == want for got, want in zip(digests, expected))
    wrong = sum(got is not None and got != want for got, want in zip(digests, expected))
    return verified, wrong


# -- the new process -----------------------------------------------------------------------
def _read_disk_main() -> None:
    """In the child: stdin ``{"dir", "capacity", "nbytes", "keys": [hex]}`` → stdout
    ``{"digests": [hex or null], "seconds": float}``."""
    from kvtier.tiers.base import Status
    from kvtier.tiers.disk import DiskTier

    request = json.load(sys.stdin)
    start = time.perf_counter()
    digests = []
    with DiskTier(request["dir"], request["capacity"]) as disk:
        out = np.empty(request["nbytes"], np.uint8)
        for key_hex in request["keys"]:
            out.fill(POISON)  # a get that reports OK without writing fails the digest
            ok = disk.get(bytes.fromhex(key_hex), out) is Status.OK
            digests.append(_digest(out) if ok else None)
    print(json.dumps({"digests": digests, "seconds": time.perf_counter() - start}))


def _read_in_new_process(directory: str, capacity: int, nbytes: int, keys: list[bytes]) -> dict:
    request = json.dumps({"dir": directory, "capacity": capacity, "nbytes": nbytes, "keys": [k.hex() for k in keys]})
    code = "from kvtier.bench.restart import _read_disk_main; _read_disk_main()"
    done = subprocess.run([sys.executable, "-c", code], input=request, capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the reading process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- embedded ------------------------------------------------------------------------------
def run_embedded(blocks: int, block_bytes: int, workdir: str) -> dict:
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostTier

    directory = os.path.join(workdir, "disk")
    disk_capacity = 2 * blocks * (block_bytes + 8 * KIB) + 16 * MIB  # header page + padding, with room
    keys = _chained_keys(blocks, b"embedded")
    payloads = _payloads(blocks, block_bytes, seed=1)
    expected = [_digest(p) for p in payloads]
    store = TieredStore([HostTier(blocks * block_bytes, block_bytes), DiskTier(directory, disk_capacity)])
    start = time.perf_counter()
    statuses = store.put(keys, payloads)
    put_s = time.perf_counter() - start
    if sum(s.ok for s in statuses) != blocks:
        raise RuntimeError(f"the host tier refused {blocks - sum(s.ok for s in statuses)} of {blocks} puts")
    start = time.perf_counter()
    report = store.close()
    close_s = time.perf_counter() - start
    del payloads
    read = _read_in_new_process(directory, disk_capacity, block_bytes, keys)
    verified, wrong = _judge(read["digests"], expected)
    return {
        "put_s": round(put_s, 4),
        "close_flush_s": round(close_s, 4),
        "flushed": report.flushed,
        "dropped": report.dropped,
        "recovered_ratio": round(verified / blocks, 4),
        "recovered_blocks": verified,
        "wrong_blocks": wrong,
        "verify_s": round(read["seconds"], 4),
    }


# -- server ----------------------------------------------------------------------------------
def run_server(blocks: int, block_bytes: int, workdir: str, timeout_s: float = 60.0) -> dict:
    from kvtier.server.launch import ServerProcess
    from kvtier.tiers.remote import RemoteTier

    disk_dir = os.path.join(workdir, "server-disk")
    os.makedirs(disk_dir, exist_ok=True)
    token = secrets.token_urlsafe(24)
    pool = 2 * blocks * block_bytes + 64 * MIB  # the host pool holds every block: the spill is the flush's
    settings = {
        "capacity": f"{-(-pool // MIB)}MiB",
        "max_block": f"{max(1, -(-block_bytes // MIB))}MiB",
        "disk_dir": disk_dir,
        "disk_capacity": f"{-(-(4 * pool) // MIB)}MiB",
    }
    tenants = {"bench": {"token": token}}
    keys = _chained_keys(blocks, b"server")
    payloads = _payloads(blocks, block_bytes, seed=2)
    expected = [_digest(p) for p in payloads]

    server = ServerProcess.start(tenants, server=settings)
    try:
        tier = RemoteTier(server.url, token, namespace=_NAMESPACE, timeout_s=timeout_s)
        try:
            statuses = tier.put_many(keys, payloads)
        finally:
            tier.close()
        start = time.perf_counter()
        server.stop(timeout_s=timeout_s)  # SIGTERM, then SIGKILL after timeout_s
        stop_s = time.perf_counter() - start
    finally:
        server.stop()
    del payloads

    server = ServerProcess.start(tenants, server=settings)
    try:
        tier = RemoteTier(server.url, token, namespace=_NAMESPACE, timeout_s=timeout_s)
        try:
            out = np.empty(block_bytes, np.uint8)
            digests = []
            for key in keys:
                out.fill(POISON)
                digests.append(_digest(out) if tier.get(key, out).ok else None)
        finally:
            tier.close()
    finally:
        server.stop()
    verified, wrong = _judge(digests, expected)
    return {
        "server_put_ok": sum(s.ok for s in statuses),
        "server_stop_s": round(stop_s, 4),
        "server_recovered_ratio": round(verified / blocks, 4),
        "server_recovered_blocks": verified,
        "server_wrong_blocks": wrong,
    }


def run(blocks: int = 256, block_kib: int = 256, workdir: str | None = None, server: bool = True) -> dict:
    if blocks < 1 or block_kib < 1:
        raise ConfigError(f"--blocks and --block-kib must be positive, got {blocks} and {block_kib}")
    if workdir is not None and not os.path.isdir(workdir):
        raise ConfigError(f"--dir {workdir!r} is not a directory")
    block_bytes = block_kib * KIB
    _refuse_beyond_the_host(blocks, block_bytes, workdir or tempfile.gettempdir())
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-restart-", dir=workdir)
    try:
        result = {"blocks": blocks, "block_bytes": block_bytes, **run_embedded(blocks, block_bytes, workdir)}
        if server:
            try:
                result.update(run_server(blocks, block_bytes, workdir))
            except (ImportError, RuntimeError, OSError) as exc:
                result["server_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _refuse_beyond_the_host(blocks: int, block_bytes: int, directory: str) -> None:
    """Lower bounds of what a run holds: every block twice in memory (the payloads put, the host
    tier's pool) and once on disk (the disk tier's files, written back at close). ``--blocks``
    of ten trillion was accepted, and ran until killed."""
    from kvtier.bench.storage import refuse_beyond_free_space, refuse_beyond_memory

    sizes = f"--blocks {blocks} x --block-kib {block_bytes // KIB}"
    refuse_beyond_memory(sizes, 2 * blocks * block_bytes)
    refuse_beyond_free_space(sizes, blocks * block_bytes, directory)


def register(subparsers) -> None:
    p = subparsers.add_parser("restart", help="blocks recovered by a new process after close / a server restart")
    p.add_argument("--blocks", type=int, default=256, help="blocks per section (default 256)")
    p.add_argument("--block-kib", type=int, default=256, help="block size in KiB (default 256)")
    p.add_argument("--dir", default=None, help="where the temporary directories go (default: the system's)")
    p.add_argument("--no-server", action="store_true", help="skip the kvtier serve section")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def failures(result: dict, server: bool) -> list[str]:
    """What makes a run no pass, one line each: a block read back OK with other bytes (a cache may
    lose, never return a wrong block), or, when the server section was asked for, that it did
    not run. Empty for a pass; ``_main`` turns any into exit status 1."""
    lines = [f"{result[key]} of {result['blocks']} blocks {where} came back with other bytes than were put"
             for key, where in (("wrong_blocks", "read by a new process"),
                                ("server_wrong_blocks", "read from the restarted server"))
             if result.get(key)]
    if server and "server_error" in result:
        lines.append(f"the server section did not run ({result['server_error']}); --no-server skips it")
    return lines


def _main(args) -> int:
    result = run(args.blocks, args.block_kib, args.dir, server=not args.no_server)
    if args.json:
        print(strict_json(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}  {value}")
    failed = failures(result, server=not args.no_server)
    for line in failed:
        # said after the figures, never instead of them, as bench vllm and the demo do
        print(f"kvtier bench restart: {line}", file=sys.stderr)
    return 1 if failed else 0
