"""``kvtier bench remote --target mooncake``: MooncakeTier against the bare Mooncake client and a socket pair.

A real ``mooncake_master`` and one segment-holder process on loopback; this process is a
pure client (it contributes no memory), so every put writes into the holder's segment
and every get reads from it, as engines would. Per block size, each run times, close
together on the same block bytes:

* ``bare``: the engine's own ``batch_put_from`` / ``batch_get_into`` on a registered buffer,
  nothing verified: one call per batch, as engines call it;
* ``bare_session``: the bare client moving the batch the way the tier does, nothing verified:
  one put/get session (the master asked once for the batch), then one call per block, all at
  once. The tier is held to the *faster* of the two (``*_ratio_vs_mooncake``), so that neither
  side gets an advantage the other lacks; the ratio against each is reported beside;
* ``kvtier``: :class:`~kvtier.tiers.mooncake.MooncakeTier` ``put_many`` / ``get_many``
  (keyed names, headers, keyed tags, verified reads, deadlines) on the same registered
  buffers (``register_memory``: received straight into them, verified in place);
* ``sealed``: the same through :class:`~kvtier.tiers.encrypted.EncryptedTier`, beside the raw
  AES-256-GCM rate of this machine, measured the way the sealed tier seals (``encrypt_into`` of
  2 MiB chunks into a preallocated buffer, one thread);
* ``socket``: a Python socket pair moving the same bytes (``sendall`` / ``recv_into``).

Medians of ``runs`` at the largest size and proportionally more at smaller ones (``runs_per_size``:
every size's median rests on the same bytes moved; a 4 x 8 MiB phase lasts ~18 ms, and 7 of them
swung 0.73-0.91 between quiet runs); ratios are of medians of the same run set (``*_paired``: the median of
each run's own kvtier/bare ratio, the steadier figure on a shared machine).
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time

import numpy as np

from kvtier.tiers.base import Status


def _socket_rate(data: np.ndarray, out: np.ndarray, count: int) -> float:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def send() -> None:
        for _ in range(count):
            a.sendall(data)

    th = threading.Thread(target=send)
    start = time.perf_counter()
    th.start()
    view = memoryview(out)
    for _ in range(count):
        got = 0
        while got < out.nbytes:
            got += b.recv_into(view[got:])
    th.join()
    took = time.perf_counter() - start
    a.close()
    b.close()
    return count * data.nbytes / took


def _aes_rate(data: np.ndarray) -> float:
    """AES-256-GCM over ``data`` as :func:`kvtier.crypto.aead.seal_into` runs it: ``encrypt_into``
    of its chunks into a preallocated buffer, on one thread (best of three passes). (One
    ``encrypt()`` of the whole block, which allocates its output and runs out of cache, measured
    ~0.7 GB/s here: a figure of no code path of kvtier's.)"""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvtier.crypto.aead import DEFAULT_CHUNK_BYTES

    aead = AESGCM(os.urandom(32))
    out = np.empty(DEFAULT_CHUNK_BYTES + 16, np.uint8)
    nonce = os.urandom(12)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for lo in range(0, data.nbytes, DEFAULT_CHUNK_BYTES):
            aead.encrypt_into(nonce, data[lo:lo + DEFAULT_CHUNK_BYTES], None, out)
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


class _BareSession:
    """The bare client moving a batch the way the tier does (nothing verified, no header): one
    session for the batch, one call per block, all running at once."""

    def __init__(self, engine, config) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.engine, self.config = engine, config
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="bench-bare-session")

    def put(self, names, bufs) -> list[int]:
        e = self.engine
        codes = e.batch_put_session_start(names, [b.nbytes for b in bufs], self.config)
        calls = [self.pool.submit(e.batch_put_from_multi_buffer_ranges, [name], [[b.ctypes.data]], [[b.nbytes]], [[0]])
                 for name, b in zip(names, bufs)]
        wrote = [f.result()[0] for f in calls]
        ended = e.batch_put_session_end(names)
        return [c or (w - b.nbytes) or x for c, w, b, x in zip(codes, wrote, bufs, ended)]  # all 0: stored whole

    def get(self, names, bufs) -> list[int]:
        e = self.engine
        e.batch_get_session_start(names)
        calls = [self.pool.submit(e.batch_get_into_multi_buffer_ranges, [name], [[b.ctypes.data]], [[b.nbytes]], [[0]])
                 for name, b in zip(names, bufs)]
        got = [f.result()[0] for f in calls]
        e.batch_get_session_end(names)
        return got

    def close(self) -> None:
        self.pool.shutdown()


def run(sizes_mib=(8, 32), blocks: int = 4, runs: int = 5, sealed: bool = True) -> dict:
    import tempfile

    from kvtier.tiers.mooncake import MooncakeTier
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    segment = int(max(sizes_mib) * (1 << 20) * blocks * 4 + (256 << 20))
    # the same bytes per size: short phases are noisier, so smaller blocks get more runs
    runs_per_size = {mib: runs * max(1, round(max(sizes_mib) / mib)) for mib in sizes_mib}
    result: dict = {"target": "mooncake", "blocks_per_phase": blocks, "runs": runs, "holders": 1,
                    "runs_per_size": {f"{mib:g}mib": r for mib, r in runs_per_size.items()},
                    "transport": "tcp loopback", "warnings": []}
    with MooncakeCluster.start(holders=1, segment_bytes=segment) as cluster:
        tier = MooncakeTier(cluster.master_address, cluster.metadata_url, tenant="bench", secret=os.urandom(32),
                            timeout_s=30.0)
        enc = None
        if sealed:
            from kvtier.crypto.keyring import Keyring
            from kvtier.crypto.providers import StaticMasterKey
            from kvtier.tiers.encrypted import EncryptedTier

            keydir = tempfile.mkdtemp(prefix="kvtier-bench-keys-")
            enc = EncryptedTier(MooncakeTier(cluster.master_address, cluster.metadata_url, tenant="bench-sealed",
                                             secret=os.urandom(32), timeout_s=30.0),
                                Keyring(StaticMasterKey(os.urandom(32)), keydir), "bench-sealed")
        engine = tier._engine  # the same client the tier uses: bare calls on the same connection set
        bare_session = _BareSession(engine, tier._config)
        try:
            for mib in sizes_mib:
                n = int(mib * (1 << 20))
                rng = np.random.default_rng(mib)
                datas = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(blocks)]
                outs = [np.empty(n, np.uint8) for _ in range(blocks)]
                # Registered once, like an engine's KV cache: the bare client and the tier move the
                # same bytes between the same registered buffers, in batches of the same size.
                for b in (*datas, *outs):
                    tier.register_memory(b)
                rates: dict[str, list[float]] = {k: [] for k in
                                                 ("bare_put", "bare_get", "bare_session_put", "bare_session_get",
                                                  "kvtier_put", "kvtier_get",
                                                  "sealed_put", "sealed_get", "socket")}
                for run_i in range(runs_per_size[mib]):
                    names = [f"bench/{mib}/{run_i}/{i}" for i in range(blocks)]
                    keys = [int(mib * 1000 + run_i * blocks + i).to_bytes(32, "big") for i in range(blocks)]
                    codes, got, put_s, get_s = _timed_round(
                        lambda: engine.batch_put_from(names, [d.ctypes.data for d in datas], [n] * blocks),
                        lambda: engine.batch_get_into(names, [o.ctypes.data for o in outs], [n] * blocks), outs)
                    if any(codes) or any(g != n for g in got) or not _equal(outs, datas):
                        result["warnings"].append(f"bare client at {mib} MiB: put {codes} get {got}")
                    rates["bare_put"].append(blocks * n / put_s)
                    rates["bare_get"].append(blocks * n / get_s)
                    snames = [f"bench-session/{mib}/{run_i}/{i}" for i in range(blocks)]
                    codes, got, put_s, get_s = _timed_round(lambda: bare_session.put(snames, datas),
                                                            lambda: bare_session.get(snames, outs), outs)
                    if any(codes) or any(g != n for g in got) or not _equal(outs, datas):
                        result["warnings"].append(f"bare client in a session at {mib} MiB: put {codes} get {got}")
                    rates["bare_session_put"].append(blocks * n / put_s)
                    rates["bare_session_get"].append(blocks * n / get_s)
                    engine.batch_remove(snames, True)
                    ps, gs, put_s, get_s = _timed_round(lambda: tier.put_many(keys, datas),
                                                        lambda: tier.get_many(keys, outs), outs)
                    if ps != [Status.OK] * blocks or gs != [Status.OK] * blocks or not _equal(outs, datas):
                        result["warnings"].append(f"kvtier tier at {mib} MiB: put {ps} get {gs}")
                    rates["kvtier_put"].append(blocks * n / put_s)
                    rates["kvtier_get"].append(blocks * n / get_s)
                    if enc is not None:
                        ps, gs, put_s, get_s = _timed_round(lambda: enc.put_many(keys, datas),
                                                            lambda: enc.get_many(keys, outs), outs)
                        if ps != [Status.OK] * blocks or gs != [Status.OK] * blocks or not _equal(outs, datas):
                            result["warnings"].append(f"sealed tier at {mib} MiB: put {ps} get {gs}")
                        rates["sealed_put"].append(blocks * n / put_s)
                        rates["sealed_get"].append(blocks * n / get_s)
                        # the reads' leases refuse a plain removal: force, so the segment never fills
                        engine.batch_remove([enc.inner.storage_name(enc.storage_name(k)) for k in keys], True)
                    rates["socket"].append(_socket_rate(datas[0], outs[0], blocks))
                    # leave the segment as empty as it was (the reads' leases: force)
                    engine.batch_remove(names, True)
                    engine.batch_remove([tier.storage_name(k) for k in keys], True)
                for b in (*datas, *outs):
                    tier.unregister_memory(b)
                med = {k: statistics.median(v) / 1e9 for k, v in rates.items() if v}
                tag = f"{mib:g}mib"
                for k, v in med.items():
                    result[f"{k}_gbs_{tag}"] = round(v, 3)
                for op in ("get", "put"):
                    # held to the faster of the bare client's two ways of moving the batch
                    best = max(med[f"bare_{op}"], med[f"bare_session_{op}"])
                    result[f"{op}_ratio_vs_mooncake_{tag}"] = round(med[f"kvtier_{op}"] / best, 3)
                    result[f"{op}_ratio_vs_mooncake_batch_{tag}"] = round(med[f"kvtier_{op}"] / med[f"bare_{op}"], 3)
                    result[f"{op}_ratio_vs_mooncake_session_{tag}"] = round(
                        med[f"kvtier_{op}"] / med[f"bare_session_{op}"], 3)
                    # the median of each run's own ratio (to the faster bare figure of that run): a
                    # shared machine's load drifts between runs, and timings back to back see the same
                    result[f"{op}_ratio_vs_mooncake_paired_{tag}"] = round(statistics.median(
                        k / max(b, bs) for k, b, bs in
                        zip(rates[f"kvtier_{op}"], rates[f"bare_{op}"], rates[f"bare_session_{op}"])), 3)
                result[f"get_ratio_vs_socket_{tag}"] = round(med["kvtier_get"] / med["socket"], 3)
                result[f"put_ratio_vs_socket_{tag}"] = round(med["kvtier_put"] / med["socket"], 3)
                result[f"bare_get_ratio_vs_socket_{tag}"] = round(med["bare_get"] / med["socket"], 3)
                result[f"bare_put_ratio_vs_socket_{tag}"] = round(med["bare_put"] / med["socket"], 3)
                if enc is not None:
                    result[f"sealed_get_ratio_vs_plain_{tag}"] = round(med["sealed_get"] / med["kvtier_get"], 3)
                    result[f"sealed_put_ratio_vs_plain_{tag}"] = round(med["sealed_put"] / med["kvtier_put"], 3)
                    result[f"aes_gcm_gbs_{tag}"] = round(_aes_rate(datas[0]) / 1e9, 3)
        finally:
            bare_session.close()
            if enc is not None:
                enc.close()
            tier.close()
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return result


def _timed_round(put, get, outs):
    """``put()``, then ``get()`` into ``outs`` poisoned first (untimed: a get that writes nothing
    must fail its check); their results and seconds."""
    t0 = time.perf_counter()
    put_result = put()
    put_s = time.perf_counter() - t0
    _poison(outs)
    t0 = time.perf_counter()
    got = get()
    return put_result, got, put_s, time.perf_counter() - t0


def _poison(bufs) -> None:
    for b in bufs:
        b.fill(0xA5)


def _equal(outs, datas) -> bool:
    return all(np.array_equal(o, d) for o, d in zip(outs, datas))
