"""``kvtier bench remote``: the shared server's put/get throughput against limits measured in the same run.

One run puts ``--run-mib`` of ``--block-mib`` blocks three ways back to back,
then gets them back the same three ways; the order rotates run by run and the
phases are short, so that the noise of a shared machine hits all of them alike:

* **kvtier**: a ``kvtier serve`` subprocess (TCP loopback, or ``--unix``);
  ``RemoteTier.put_many`` of every block (pipelined), then ``get_many`` of all
  of them into warm caller buffers. Every byte is checksummed both ways.
* **socket** (the raw limit): a peer process moving the same bytes over the
  same kind of socket with ``sendall`` / ``recv_into`` between warm buffers,
  with nothing else: no protocol, no checksum, no storage.
* **redis-py**: a real ``redis-server`` (loopback or its unix socket, no
  persistence), redis-py with hiredis; blocks chunked into values of at most
  1 MiB (pipelined SETs; pipelined GETs copied into the same caller buffers).
  This measures redis-py's copies as much as the server, so beside it:
* **redis-benchmark**: the C client shipped with redis-server, on the same
  server, values of redis-py's size (``redis_value_bytes``: the block, or 1 MiB
  for larger blocks) and one connection (``-c 1``, pipelined ``-P 16``), once
  after the runs: SET and GET at what Redis itself can do (its GETs discard the
  value; no copy into a caller's buffer).

With ``--encrypt`` (Redis is left out) two more systems join the rotation:

* **sealed**: ``EncryptedTier`` over ``RemoteTier`` -- end to end, the client
  seals each 512 KiB chunk and sends it at once (two lanes, each on its own
  connection and thread), the server stores ciphertext; gets open each chunk
  as it lands. ``encrypt_ratio`` is the lower of its put and get ratios (below).
* **kvtier in two lanes**: the plain path split the same way, to show what
  the lanes alone are worth (``plain_lanes_*_ratio``, two lanes ÷ one).

``encrypt_*_ratio`` is sealed ÷ the *best* plain lane count of the same run
(per run, the faster of one and two lanes), so that the lanes can never flatter
the sealed path; ``encrypt_*_ratio_vs_one_lane`` is sealed ÷ one lane. Sealing
only adds work, so an ``encrypt_*_ratio`` above 1.05 is warned about: the plain
baseline is wrong.

Each throughput is a median over runs in GB/s (1e9 bytes/s); each ratio is the
median of per-run ratios (paired, so slow phases of the machine cancel).

Before each system's gets every caller buffer is poisoned, and after them every
block is compared with what was put (both outside the timing): a system whose
get reports success without writing, or writes other bytes, stops the benchmark
with an error instead of posting a fast figure.

``--quota-stress`` asks something else: does one tenant at its quota stall the
server? It starts a ``kvtier serve`` (TCP loopback, or ``--unix``) whose tenant
has a quota of exactly ``--blocks`` tiny blocks (64 B each, charged the pool
footprint the server charges such a block: ``footprint_per_block``, whole pages),
fills the index to that many with pipelined batches, then makes
``--measure-puts`` single PUTs of new blocks -- each one must first evict the
tenant's least recently used block. The account is checked: a tenant holding
other than ``--blocks`` blocks after the fill or after the measured PUTs (its
quota is not what the figure is posted for) stops the bench. It prints the server's own time per PUT (its
``kvtier_request_seconds{op="put"}`` histogram over the measured puts only,
read with the admin token: ``put_p50_ms`` / ``put_p99_ms`` are the upper edges
of the buckets that hold those percentiles, so upper bounds; a percentile above
the histogram's last finite bucket is printed as that edge, a lower bound, and
named in ``above_last_bucket`` and ``warnings``) and the client's round trips
(``client_put_*``), with ``blocks_indexed`` from the admin STATS.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

import numpy as np

from kvtier.bench.baselines import ratio_warnings, report_warnings
from kvtier.child_process import die_with_parent
from kvtier.core.units import finite_float
from kvtier.crypto.aead import sealed_stream_nbytes
from kvtier.errors import ConfigError

MIB = 1 << 20
_LANES = 2  #: lanes of the sealed path (EncryptedTier's default)
_CMD = struct.Struct("<cQQ")  # op (R: receive, S: send), total bytes, block bytes


# -- the raw limit: a peer process that only moves bytes ----------------------------------
def _peer_main(family: int, address, ring_bytes: int) -> None:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.connect(address)
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ring = np.ones(ring_bytes, np.uint8)  # warm, like the server's pool
    mv = memoryview(ring)
    cmd = bytearray(_CMD.size)
    while True:
        got = 0
        while got < len(cmd):
            k = sock.recv_into(memoryview(cmd)[got:])
            if k == 0:
                return
            got += k
        op, total, block = _CMD.unpack(cmd)
        pos = 0
        if op == b"R":
            left = total
            while left:
                n = min(block, left)
                view = mv[pos : pos + n]
                r = 0
                while r < n:
                    r += sock.recv_into(view[r:])
                left -= n
                pos = (pos + n) % (ring_bytes - block + 1) if ring_bytes > block else 0
            sock.sendall(b"k")
        else:
            left = total
            while left:
                n = min(block, left)
                sock.sendall(mv[pos : pos + n])
                left -= n
                pos = (pos + n) % (ring_bytes - block + 1) if ring_bytes > block else 0


class RawPeer:
    def __init__(self, unix_dir: str | None, ring_bytes: int) -> None:
        if unix_dir:
            path = os.path.join(unix_dir, "raw.sock")
            lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lsock.bind(path)
            family, address = socket.AF_UNIX, path
        else:
            lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            lsock.bind(("127.0.0.1", 0))
            family, address = socket.AF_INET, lsock.getsockname()
        lsock.listen(1)
        code = f"from kvtier.bench.remote import _peer_main; _peer_main({int(family)}, {address!r}, {ring_bytes})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        lsock.settimeout(30)
        self.sock, _ = lsock.accept()
        lsock.close()
        if family == socket.AF_INET:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, blocks: list[np.ndarray]) -> None:
        """Send every block to the peer; return when it has received them all."""
        total = sum(b.nbytes for b in blocks)
        self.sock.sendall(_CMD.pack(b"R", total, blocks[0].nbytes))
        for b in blocks:
            self.sock.sendall(memoryview(b))
        if self.sock.recv(1) != b"k":
            raise RuntimeError("raw peer failed")

    def get(self, outs: list[np.ndarray]) -> None:
        """Receive one block per buffer from the peer."""
        total = sum(o.nbytes for o in outs)
        self.sock.sendall(_CMD.pack(b"S", total, outs[0].nbytes))
        for o in outs:
            view = memoryview(o).cast("B")
            got = 0
            while got < len(view):
                got += self.sock.recv_into(view[got:])

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- redis --------------------------------------------------------------------------------
class RedisPeer:
    CHUNK = MIB  #: the largest value a block is cut into

    @classmethod
    def value_bytes(cls, block_nbytes: int) -> int:
        """The size of the values redis-py moves for blocks of ``block_nbytes`` (all but a tail)."""
        return min(block_nbytes, cls.CHUNK)

    def __init__(self, workdir: str, unix: bool) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
        port = _free_port()
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--dir", workdir, "--logfile", os.path.join(workdir, "redis.log")]
        sock_path = os.path.join(workdir, "redis.sock")
        if unix:
            args += ["--unixsocket", sock_path, "--unixsocketperm", "700"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        #: where redis-benchmark finds the server
        self.endpoint = ["-s", sock_path] if unix else ["-h", "127.0.0.1", "-p", str(port)]
        kw = {"unix_socket_path": sock_path} if unix else {"host": "127.0.0.1", "port": port}
        self.client = redis.Redis(**kw, socket_timeout=60)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        from redis.utils import HIREDIS_AVAILABLE

        self.hiredis = bool(HIREDIS_AVAILABLE)

    def _chunks(self, key: bytes, view: memoryview):
        for j, off in enumerate(range(0, len(view), self.CHUNK)):
            yield key + j.to_bytes(4, "little"), view[off : off + self.CHUNK]

    def put(self, keys: list[bytes], blocks: list[np.ndarray]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, b in zip(keys, blocks):
            for ck, chunk in self._chunks(key, memoryview(b).cast("B")):
                pipe.set(ck, chunk)
        if not all(pipe.execute()):
            raise RuntimeError("redis SET failed")

    def get(self, keys: list[bytes], outs: list[np.ndarray]) -> None:
        pipe = self.client.pipeline(transaction=False)
        views = []
        for key, o in zip(keys, outs):
            for ck, chunk in self._chunks(key, memoryview(o).cast("B")):
                pipe.get(ck)
                views.append(chunk)
        for value, view in zip(pipe.execute(), views):
            if value is None or len(value) != len(view):
                raise RuntimeError("redis GET missed")
            view[:] = value  # into the caller's buffer, like the other two

    def delete(self, keys: list[bytes], blocks: list[np.ndarray]) -> None:
        names = [ck for key, b in zip(keys, blocks) for ck, _ in self._chunks(key, memoryview(b).cast("B"))]
        for i in range(0, len(names), 1000):
            self.client.delete(*names[i : i + 1000])

    def c_client_gbps(self, value_bytes: int, requests: int, pipeline: int = 16) -> dict[str, float]:
        """SET and GET GB/s of ``redis-benchmark`` (the C client) on this server: one connection,
        ``requests`` values of ``value_bytes``, ``pipeline`` in flight."""
        exe = shutil.which("redis-benchmark")
        if exe is None:
            raise FileNotFoundError("redis-benchmark is not installed (it comes with redis-server: apt-get install -y redis-server)")
        out = subprocess.run(
            [exe, *self.endpoint, "-t", "set,get", "-d", str(value_bytes), "-n", str(requests), "-c", "1",
             "-P", str(pipeline), "--csv"],  # no -r: every GET finds the one key SET wrote (a miss is a tiny reply)
            capture_output=True, text=True, timeout=300, check=True).stdout
        rps = {}
        for line in out.splitlines():  # "SET","1234.5",... (a header line first in newer versions)
            fields = [f.strip('"') for f in line.split(",")]
            if len(fields) >= 2 and fields[0] in ("SET", "GET"):
                rps[fields[0]] = float(fields[1])
        if set(rps) != {"SET", "GET"}:
            raise RuntimeError(f"redis-benchmark printed no SET/GET figures: {out[-500:]!r}")
        # every GET must have fetched a whole value: the one key the SETs wrote holds one
        if self.client.dbsize() != 1 or self.client.strlen("key:__rand_int__") != value_bytes:
            raise RuntimeError("redis-benchmark's GETs did not all read one stored value of the size asked")
        self.client.flushall()
        return {op.lower(): round(r * value_bytes / 1e9, 3) for op, r in rps.items()}

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys(tag: str, run: int, blocks: int) -> list[bytes]:
    return [hashlib.sha256(f"bench-remote/{tag}/{run}/{i}".encode()).digest() for i in range(blocks)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


#: the byte every get buffer holds before a system's gets; its gets must overwrite all of it
POISON = 0xA5
_NAMES = {"kv": "kvtier", "s": "raw socket", "r": "redis", "e": "encrypted kvtier", "l": "kvtier in lanes"}


def _verify_gets(system: str, outs: list[np.ndarray], srcs: list[np.ndarray]) -> None:
    for i, (got, want) in enumerate(zip(outs, srcs)):
        if not np.array_equal(got, want):
            what = "was never written (still poisoned)" if np.all(got == POISON) else "holds other bytes than were put"
            raise RuntimeError(f"{_NAMES.get(system, system)} get of block {i} reported success but the buffer {what}")


def run(block_mib: float, run_mib: int, runs: int, unix: bool, with_redis: bool = True,
        encrypt: bool = False) -> dict:
    from kvtier.server.launch import ServerProcess
    from kvtier.tiers.remote import RemoteTier

    if not math.isfinite(block_mib) or block_mib * MIB < 1 or run_mib < 1 or runs < 1:
        raise ConfigError(f"--block-mib, --run-mib and --runs must be positive, got {block_mib}, {run_mib} "
                          f"and {runs}")
    nbytes = int(block_mib * MIB)
    blocks = max(4, -(-run_mib * MIB // nbytes))
    total = nbytes * blocks
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-remote-")
    token = hashlib.sha256(os.urandom(16)).hexdigest()
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(blocks)]
    outs = [np.ones(nbytes, np.uint8) for _ in range(blocks)]  # warm
    server = raw = red = tier = sealed = laned = hiredis = None
    res: dict[str, list[float]] = {
        k: [] for k in ("put", "get", "sput", "sget", "rput", "rget", "eput", "eget", "lput", "lget")
    }
    try:
        # End-to-end encryption: the client seals, the server stores ciphertext.
        max_block = sealed_stream_nbytes(nbytes) if encrypt else nbytes
        pool = (3 if encrypt else 1) * (blocks + 4) * max_block
        server = ServerProcess.start(
            {"bench": token}, unix=unix, tcp=not unix, workdir=workdir,
            server={"capacity": pool, "max_block": max_block},
        )
        tier = RemoteTier(server.url, token, namespace="bench", timeout_s=60, pool_size=1)
        if encrypt:
            from kvtier.crypto.keyring import Keyring
            from kvtier.crypto.providers import StaticMasterKey
            from kvtier.tiers.encrypted import EncryptedTier

            keyring = Keyring(StaticMasterKey(os.urandom(32)), os.path.join(workdir, "keys"))
            # Sealing needs a core of its own: the sealed batch runs in two lanes, each
            # sealing and sending on its own connection (see EncryptedTier).
            inner = RemoteTier(server.url, token, namespace="bench-sealed", timeout_s=60, pool_size=_LANES)
            sealed = EncryptedTier(inner, keyring, "bench", streams=_LANES)
            laned = RemoteTier(server.url, token, namespace="bench-lanes", timeout_s=60, pool_size=_LANES)
            with_redis = False
        raw = RawPeer(workdir if unix else None, total)
        redis_error = None
        if with_redis:
            try:
                red = RedisPeer(workdir, unix)
            except (FileNotFoundError, RuntimeError, ImportError) as exc:
                redis_error = str(exc)

        def timed(fn, *args) -> float:
            t0 = time.perf_counter()
            fn(*args)
            return _gbps(total, time.perf_counter() - t0)

        def kv_put(keys):
            statuses = tier.put_many(keys, srcs)
            if not all(s.ok for s in statuses):
                bad = [s.name for s in statuses if not s.ok][:3]
                raise RuntimeError(f"kvtier put failed: {bad}; {tier.last_error}")

        def kv_get(keys):
            statuses = tier.get_many(keys, outs)
            if not all(s.ok for s in statuses):
                bad = [s.name for s in statuses if not s.ok][:3]
                raise RuntimeError(f"kvtier get failed: {bad}; {tier.last_error}")

        def enc_put(keys):
            statuses = sealed.put_many(keys, srcs)
            if not all(s.ok for s in statuses):
                raise RuntimeError(f"encrypted put failed: {[s.name for s in statuses if not s.ok][:3]}")

        def enc_get(keys):
            statuses = sealed.get_many(keys, outs)
            if not all(s.ok for s in statuses):
                raise RuntimeError(f"encrypted get failed: {[s.name for s in statuses if not s.ok][:3]}")

        def in_lanes(op, keys, bufs):
            # what EncryptedTier does with a batch: block i in lane i mod LANES, lanes 1.. on threads
            results: list = [None] * _LANES

            def lane(j):
                results[j] = op(keys[j::_LANES], bufs[j::_LANES])

            others = [threading.Thread(target=lane, args=(j,)) for j in range(1, _LANES)]
            for t in others:
                t.start()
            lane(0)
            for t in others:
                t.join()
            if not all(s is not None and s.ok for part in results for s in part):
                raise RuntimeError(f"kvtier in lanes failed; {laned.last_error}")

        hiredis = red.hiredis if red is not None else None
        # (name, put, get, cleanup) per system; keys are per run
        systems = [
            ("kv", kv_put, kv_get, lambda keys: tier.delete_many(keys)),
            ("s", lambda keys: raw.put(srcs), lambda keys: raw.get(outs), lambda keys: None),
        ]
        if encrypt:
            systems.append(("e", enc_put, enc_get, lambda keys: sealed.delete_many(keys)))
            systems.append(("l", lambda keys: in_lanes(laned.put_many, keys, srcs),
                            lambda keys: in_lanes(laned.get_many, keys, outs), lambda keys: laned.delete_many(keys)))
        if red is not None:
            systems.append(("r", lambda keys: red.put(keys, srcs), lambda keys: red.get(keys, outs),
                            lambda keys: red.delete(keys, srcs)))
        for r in range(-1, runs):  # run -1 warms up; not counted
            keys = _keys("bench", r, blocks)
            k = (r + 1) % len(systems)
            order = systems[k:] + systems[:k]
            # All puts back to back, then all gets: each pair shares the machine's state of the moment.
            puts = {name: timed(put, keys) for name, put, _, _ in order}
            gets = {}
            for name, _, get, _ in reversed(order):
                for out in outs:  # untimed; the buffers stay warm (faulted in), only their bytes change
                    out.fill(POISON)
                gets[name] = timed(get, keys)
                _verify_gets(name, outs, srcs)
            for _, _, _, cleanup in order:
                cleanup(keys)
            if r >= 0:
                for name in puts:
                    prefix = "" if name == "kv" else name
                    res[prefix + "put"].append(puts[name])
                    res[prefix + "get"].append(gets[name])
        redis_c = None
        redis_value = RedisPeer.value_bytes(nbytes)
        if red is not None:  # the C client on the same server and value size, after the runs
            try:
                redis_c = red.c_client_gbps(redis_value, max(64, 4 * total // redis_value))
            except (FileNotFoundError, RuntimeError, subprocess.SubprocessError) as exc:
                redis_error = f"redis-benchmark: {exc}"
    finally:
        for thing in (tier, raw, red, sealed, laned):
            if thing is not None:
                thing.close()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 3) if xs else None

    def ratio(a: str, b: str) -> float | None:
        return round(statistics.median(x / y for x, y in zip(res[a], res[b])), 3) if res[b] else None

    def vs_best_plain(sealed_runs: str, one: str, lanes: str) -> float:
        # per run, against the faster plain lane count of that run
        return round(statistics.median(e / max(a, b) for e, a, b in zip(res[sealed_runs], res[one], res[lanes])), 3)

    encrypted = {}
    if encrypt:
        put_ratio, get_ratio = vs_best_plain("eput", "put", "lput"), vs_best_plain("eget", "get", "lget")
        encrypted = {
            "encrypted_put_gbps": med(res["eput"]),
            "encrypted_get_gbps": med(res["eget"]),
            "encrypt_put_ratio": put_ratio,
            "encrypt_get_ratio": get_ratio,
            "encrypt_ratio": min(put_ratio, get_ratio),
            "encrypt_baseline": "per run, the faster of 1 and 2 plain lanes",
            "encrypt_put_ratio_vs_one_lane": ratio("eput", "put"),
            "encrypt_get_ratio_vs_one_lane": ratio("eget", "get"),
            "encrypt_lanes": _LANES,
            "plain_lanes_put_gbps": med(res["lput"]),
            "plain_lanes_get_gbps": med(res["lget"]),
            "plain_lanes_put_ratio": ratio("lput", "put"),
            "plain_lanes_get_ratio": ratio("lget", "get"),
        }
    result = {
        "bench": "remote",
        "transport": "unix" if unix else "tcp",
        "block_mib": block_mib,
        "blocks_per_run": blocks,
        "runs": runs,
        "put_gbps": med(res["put"]),
        "get_gbps": med(res["get"]),
        "socket_put_gbps": med(res["sput"]),
        "socket_get_gbps": med(res["sget"]),
        # redis-py (with hiredis): the Python client's copies are part of this figure
        "redis_py_put_gbps": med(res["rput"]),
        "redis_py_get_gbps": med(res["rget"]),
        "put_ratio_vs_socket": ratio("put", "sput"),
        "get_ratio_vs_socket": ratio("get", "sget"),
        "put_ratio_vs_redis_py": ratio("put", "rput"),
        "get_ratio_vs_redis_py": ratio("get", "rget"),
        "redis_hiredis": hiredis,
        # redis-benchmark (C client), same server, redis-py's value size, one connection, -P 16
        "redis_benchmark_set_gbps": redis_c["set"] if redis_c else None,
        "redis_benchmark_get_gbps": redis_c["get"] if redis_c else None,
        "redis_value_bytes": redis_value,
        # a block that is not whole values ends in a shorter one (redis-py only; not in the C figure)
        **({"redis_tail_value_bytes": nbytes % redis_value} if nbytes % redis_value else {}),
        **({"redis_error": redis_error} if with_redis and (red is None or redis_c is None) else {}),
        **encrypted,
    }
    # the socket is the hardware limit here: a ratio well above 1.0 against it is a wrong baseline
    result["warnings"] = ratio_warnings({k: result[k] for k in ("put_ratio_vs_socket", "get_ratio_vs_socket")},
                                        what="raw socket")
    # Sealing only adds work to the plain transfer: faster than it, the plain side is wrong. Against
    # the best plain lane count only: the sealed path runs in lanes, so beating one plain lane can be
    # the lanes' doing (plain_lanes_*_ratio), not a wrong baseline.
    if encrypt:
        result["warnings"] += ratio_warnings({k: result[k] for k in ("encrypt_put_ratio", "encrypt_get_ratio")},
                                             what="plain kvtier (the same transfer without sealing)")
    return result


# -- one tenant at its quota ------------------------------------------------------------------
_STRESS_BLOCK = 64  # bytes: tiny blocks, so that the index holds many in little memory
_STRESS_MAX_BLOCK = 64 << 10  # the server's largest block: a pool of whole pages, like any real server's
_STRESS_HEADROOM = 64 * MIB  # pool beyond the quota: the quota binds, never the pool
#: the server-side PUT times posted, and the share of the measured PUTs each is the bound of
_STRESS_QUANTILES = {"put_p50_ms": 0.50, "put_p99_ms": 0.99, "put_max_bucket_ms": 1.0}


def _stress_footprint() -> int:
    """The bytes of quota the server charges for one stress block: its pool's rule (the pool is a
    ``HostTier`` without slabs, ``kvtier/server/server.py``: a 64 B block takes a whole page).
    Should the rules drift apart, :func:`_held_at_quota` stops the bench."""
    from kvtier.tiers.host import HostTier

    pool = HostTier(_STRESS_MAX_BLOCK, _STRESS_MAX_BLOCK, prefault=False, slabs=False)
    try:
        return pool.footprint(_STRESS_BLOCK)
    finally:
        pool.close()


def _held_at_quota(url: str, admin_token: str, blocks: int, when: str) -> int:
    """The blocks the server indexes (all the tenant's); raises unless they are the ``blocks`` its
    quota was set for: fewer, and the PUTs evict from a smaller account than the one posted; more,
    and they evict nothing."""
    from kvtier.cli.admin import admin_call

    indexed = admin_call(url, admin_token, "stats", {})["blocks"]
    if indexed != blocks:
        raise RuntimeError(f"{when} the tenant holds {indexed} blocks, not the {blocks} its quota was set for: "
                           "the quota is not --blocks times what the server charges a block; nothing is posted")
    return indexed


def _tenant_account(tier) -> dict:
    """The tenant's own STATS: ``charged_bytes``, what its quota is charged (footprints), and
    ``tenant_bytes``, its payload. The admin ``usage`` figure is payload bytes: posted as the
    tenant's bytes beside ``quota_bytes``, a tenant exactly at its quota read as 1.6 % full."""
    stats = tier.server_stats()
    if "charged_bytes" not in stats:
        raise RuntimeError(f"the server's STATS for the tenant carry no charged_bytes ({sorted(stats)}): "
                           "nothing is posted")
    return stats


def _put_histogram(metrics_addr: str, admin_token: str) -> dict[float, float]:
    """Cumulative bucket counts (upper edge in s -> count) of the server's PUT time."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(f"http://{metrics_addr}/metrics", headers={"Authorization": f"Bearer {admin_token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvtier_request_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket") and sample.labels.get("op") == "put":
                    out[float(sample.labels["le"])] = sample.value
    return out


class BucketBound(NamedTuple):
    """Where a quantile of the server's histogram lies."""

    ms: float  #: the upper edge of its bucket; above the last finite bucket, that bucket's edge
    above_last: bool  #: it lies above the last finite bucket: ``ms`` is a lower bound, not an upper one


def _bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> BucketBound:
    """The bucket holding quantile ``q`` of the observations between two scrapes. A quantile in the
    ``+Inf`` bucket is given as the last finite edge (JSON has no infinity), marked ``above_last``."""
    edges = sorted(after)
    last_finite = max(e for e in edges if math.isfinite(e))
    total = after[edges[-1]] - before.get(edges[-1], 0.0)
    for edge in edges:
        if after[edge] - before.get(edge, 0.0) >= q * total:
            return BucketBound(min(edge, last_finite) * 1e3, edge > last_finite)
    return BucketBound(last_finite * 1e3, True)


def _stress_times(before: dict[float, float], after: dict[float, float]) -> dict:
    """The server's PUT-time bounds between two scrapes, with ``above_last_bucket`` (the ones that
    are lower bounds) and a warning naming them."""
    bounds = {name: _bucket_quantile(before, after, q) for name, q in _STRESS_QUANTILES.items()}
    above = [name for name, b in bounds.items() if b.above_last]
    warnings = [f"{', '.join(above)} lie above the server histogram's last finite bucket "
                f"({bounds[above[0]].ms:g} ms): printed as that edge, a lower bound"] if above else []
    return {**{name: b.ms for name, b in bounds.items()}, "above_last_bucket": above, "warnings": warnings}


def quota_stress(blocks: int = 500_000, measure_puts: int = 2000, batch: int = 4096, unix: bool = False) -> dict:
    from kvtier.server.launch import ServerProcess
    from kvtier.tiers.base import Status
    from kvtier.tiers.remote import RemoteTier

    token, admin = "stress-token", "stress-admin-token"
    footprint = _stress_footprint()
    quota = blocks * footprint
    data = np.arange(_STRESS_BLOCK, dtype=np.uint8)
    with ServerProcess.start({"stress": {"token": token, "quota": quota}}, admin_token=admin, unix=unix, tcp=not unix,
                             server={"capacity": quota + _STRESS_HEADROOM, "max_block": _STRESS_MAX_BLOCK,
                                     "metrics": "127.0.0.1:0"},
                             timeout_s=60) as srv:
        url = srv.unix_url if unix else srv.tcp_url
        tier = RemoteTier(url, token, namespace="stress", timeout_s=120)
        t0 = time.perf_counter()
        for start in range(0, blocks, batch):
            keys = [hashlib.sha256(b"fill/%d" % i).digest() for i in range(start, min(blocks, start + batch))]
            statuses = tier.put_many(keys, [data] * len(keys))
            if any(st is not Status.OK for st in statuses):
                raise RuntimeError(f"fill: a put answered {set(statuses)}")
        fill_s = time.perf_counter() - t0
        _held_at_quota(url, admin, blocks, "after the fill")
        before = _put_histogram(srv.info["metrics"], admin)
        rtts = []
        for i in range(measure_puts):
            key = hashlib.sha256(b"over/%d" % i).digest()
            t = time.perf_counter()
            status = tier.put(key, data)
            rtts.append(time.perf_counter() - t)
            if status is not Status.OK:
                raise RuntimeError(f"a put at quota answered {status}")
        after = _put_histogram(srv.info["metrics"], admin)
        indexed = _held_at_quota(url, admin, blocks, "after the measured puts")
        account = _tenant_account(tier)
        tier.close()
    rtts.sort()
    times = _stress_times(before, after)
    return {
        "blocks_indexed": indexed,
        "quota_blocks": blocks,
        # the quota's unit (footprints: a page a block), beside it; the payload is 64 B a block
        "tenant_charged_bytes": account["charged_bytes"],
        "quota_bytes": quota,
        "tenant_payload_bytes": account["tenant_bytes"],
        "footprint_per_block": footprint,
        "fill_s": round(fill_s, 1),
        "measured_puts": measure_puts,
        **times,
        "client_put_p50_ms": round(rtts[len(rtts) // 2] * 1e3, 3),
        # interpolated: the rank int(0.99 n) is one above the p99
        "client_put_p99_ms": round(float(np.percentile(rtts, 99)) * 1e3, 3),
        "transport": "unix" if unix else "tcp",
    }


#: what a flag left out means, in the modes that read it
_DEFAULTS = {"block_mib": 8.0, "run_mib": 64, "runs": 15, "blocks": 500_000, "measure_puts": 2000}
#: each mode of ``bench remote``: the flags it reads (argparse dests), and what it measures
#: instead of the others (said when one of those is given)
_MODES = {
    "server": (("block_mib", "run_mib", "runs", "unix", "no_redis", "encrypt"), "the server bench"),
    "mooncake": (("runs", "unix", "no_redis", "no_server"),
                 "--target mooncake measures 8 and 32 MiB blocks, plain, and the server beside them alike"),
    "mooncake alone": (("runs", "no_server"),
                       "--target mooncake --no-server runs Mooncake alone over TCP, with no server or Redis"),
    "quota-stress": (("quota_stress", "blocks", "measure_puts", "unix"),
                     "--quota-stress times single 64 B puts of one tenant at its quota, plain, in one pass"),
}
_FLAGS = sorted({name for reads, _ in _MODES.values() for name in reads})


def register(subparsers) -> None:
    # Defaults None (store_true flags: False), so that a flag is "given" when it is not: a mode
    # refuses the flags it does not read (_MODES) instead of running without them.
    p = subparsers.add_parser("remote", help="shared server put/get vs a raw socket and Redis, same run")
    p.add_argument("--block-mib", type=finite_float, default=None,
                   help=f"block size in MiB (default {_DEFAULTS['block_mib']:g})")
    p.add_argument("--run-mib", type=int, default=None,
                   help=f"bytes per phase of a run, MiB (default {_DEFAULTS['run_mib']}, at least 4 blocks): "
                        "short phases, close in time")
    p.add_argument("--runs", type=int, default=None,
                   help=f"runs (default {_DEFAULTS['runs']}; --target mooncake: at most 7, the server beside it 5)")
    p.add_argument("--unix", action="store_true", help="Unix sockets instead of TCP loopback")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis comparison")
    p.add_argument("--encrypt", action="store_true",
                   help="also end-to-end encrypted puts/gets (client seals) in the same run; prints encrypt_ratio")
    p.add_argument("--quota-stress", action="store_true",
                   help="instead: one tenant at its quota of --blocks tiny blocks; server time per PUT (p50/p99)")
    p.add_argument("--blocks", type=int, default=None,
                   help=f"--quota-stress: blocks indexed (default {_DEFAULTS['blocks']})")
    p.add_argument("--measure-puts", type=int, default=None,
                   help=f"--quota-stress: single puts timed at quota (default {_DEFAULTS['measure_puts']})")
    p.add_argument("--target", choices=("server", "mooncake"), default="server",
                   help="mooncake: MooncakeTier vs the bare Mooncake client and raw TCP loopback, 8 and 32 MiB "
                        "(kvtier/bench/mooncake.py)")
    p.add_argument("--no-server", action="store_true",
                   help="--target mooncake: skip the kvtier server and Redis figures run beside it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _mode(args) -> str:
    if args.target == "mooncake":
        return "mooncake alone" if args.no_server else "mooncake"
    return "quota-stress" if args.quota_stress else "server"


def _refuse_ignored_flags(args, mode: str) -> None:
    """Refuse, named, the flags ``mode`` would run without (as ``bench vllm --trace`` does)."""
    reads, what = _MODES[mode]
    given = ["--" + name.replace("_", "-") for name in _FLAGS
             if name not in reads and getattr(args, name) not in (None, False)]
    if given:
        named = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        one = len(given) == 1
        raise ConfigError(f"{named} {'is' if one else 'are'} not read here: {what}; leave {'it' if one else 'them'} out")


#: what of the server bench stands beside the Mooncake figures (GB/s and the socket's)
_BESIDE_KEYS = ("put_gbps", "get_gbps", "socket_put_gbps", "socket_get_gbps", "put_ratio_vs_socket",
                "get_ratio_vs_socket", "redis_py_put_gbps", "redis_py_get_gbps", "redis_benchmark_set_gbps",
                "redis_benchmark_get_gbps", "redis_error")


def _beside_mooncake(runs: int, unix: bool, with_redis: bool) -> dict:
    """The kvtier server and Redis on the same block sizes, in the same invocation, right after
    the Mooncake figures (the machine's state is the same, not another day's)."""
    beside = {}
    for mib in (8, 32):
        r = run(float(mib), max(64, 4 * mib), runs, unix, with_redis)
        beside[f"{mib}mib"] = {k: r[k] for k in _BESIDE_KEYS if k in r}
        beside.setdefault("warnings", []).extend(f"beside, {mib} MiB: {w}" for w in r.get("warnings", []))
    return beside


def _main(args) -> int:
    mode = _mode(args)
    _refuse_ignored_flags(args, mode)
    for name, default in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.runs < 1:
        # checked here for every mode: --target mooncake started a Mooncake master and holder for
        # no run, then died on the empty medians
        raise ConfigError(f"--runs must be at least 1, got {args.runs}: a median of no run is no figure")
    if mode.startswith("mooncake"):
        from kvtier.bench.mooncake import run as run_mooncake

        result = run_mooncake(runs=min(args.runs, 7))
        if not args.no_server:
            result["beside"] = _beside_mooncake(min(args.runs, 5), args.unix, not args.no_redis)
            result["warnings"] += result["beside"].pop("warnings", [])  # a wrong baseline is said, wherever it ran
    elif mode == "quota-stress":
        if args.blocks < 1 or args.measure_puts < 1:
            raise SystemExit("--blocks and --measure-puts must be positive")
        result = quota_stress(args.blocks, args.measure_puts, unix=args.unix)
    else:
        result = run(args.block_mib, args.run_mib, args.runs, args.unix, not args.no_redis, args.encrypt)
    report_warnings(result.get("warnings", []))
    if args.json:
        print(json.dumps(result, allow_nan=False))  # NaN or Infinity is no JSON: fail here, not in a reader
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    return 0
