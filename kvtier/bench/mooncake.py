"""``kvtier bench remote --target mooncake``: MooncakeTier against the bare Mooncake client and a socket pair.

A real ``mooncake_master`` and one segment-holder process on loopback; this process is a
pure client (it contributes no memory), so every put writes into the holder's segment
and every get reads from it, as engines would. Per block size, each run times, close
together on the same block bytes:

* ``bare``: the engine's own ``batch_put_from`` / ``batch_get_into`` on a registered buffer,
  nothing verified (the ceiling kvtier's tier is held to);
* ``kvtier``: :class:`~kvtier.tiers.mooncake.MooncakeTier` ``put_many`` / ``get_many``
  (keyed names, headers, keyed tags, verified reads, deadlines) on the same registered
  buffers (``register_memory``: received straight into them, verified in place);
* ``sealed``: the same through :class:`~kvtier.tiers.encrypted.EncryptedTier`, beside the raw
  AES-256-GCM rate of this machine;
* ``socket``: a Python socket pair moving the same bytes (``sendall`` / ``recv_into``).

Medians of ``runs``; ratios are of medians of the same run set (``*_paired``: the median of
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
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(os.urandom(32))
    start = time.perf_counter()
    aead.encrypt(os.urandom(12), data.tobytes(), None)
    return data.nbytes / (time.perf_counter() - start)


def run(sizes_mib=(8, 32), blocks: int = 4, runs: int = 5, sealed: bool = True) -> dict:
    import tempfile

    from kvtier.tiers.mooncake import MooncakeTier
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    segment = int(max(sizes_mib) * (1 << 20) * blocks * 4 + (256 << 20))
    result: dict = {"target": "mooncake", "blocks_per_phase": blocks, "runs": runs, "holders": 1,
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
                                                 ("bare_put", "bare_get", "kvtier_put", "kvtier_get",
                                                  "sealed_put", "sealed_get", "socket")}
                for run_i in range(runs):
                    names = [f"bench/{mib}/{run_i}/{i}" for i in range(blocks)]
                    keys = [int(mib * 1000 + run_i * blocks + i).to_bytes(32, "big") for i in range(blocks)]
                    t0 = time.perf_counter()
                    codes = engine.batch_put_from(names, [d.ctypes.data for d in datas], [n] * blocks)
                    t1 = time.perf_counter()
                    _poison(outs)  # untimed: a get that writes nothing must fail its check
                    t1p = time.perf_counter()
                    got = engine.batch_get_into(names, [o.ctypes.data for o in outs], [n] * blocks)
                    t2 = time.perf_counter()
                    if any(codes) or any(g != n for g in got) or not _equal(outs, datas):
                        result["warnings"].append(f"bare client at {mib} MiB: put {codes} get {got}")
                    rates["bare_put"].append(blocks * n / (t1 - t0))
                    rates["bare_get"].append(blocks * n / (t2 - t1p))
                    t0 = time.perf_counter()
                    ps = tier.put_many(keys, datas)
                    t1 = time.perf_counter()
                    _poison(outs)
                    t1p = time.perf_counter()
                    gs = tier.get_many(keys, outs)
                    t2 = time.perf_counter()
                    if ps != [Status.OK] * blocks or gs != [Status.OK] * blocks or not _equal(outs, datas):
                        result["warnings"].append(f"kvtier tier at {mib} MiB: put {ps} get {gs}")
                    rates["kvtier_put"].append(blocks * n / (t1 - t0))
                    rates["kvtier_get"].append(blocks * n / (t2 - t1p))
                    if enc is not None:
                        t0 = time.perf_counter()
                        ps = enc.put_many(keys, datas)
                        t1 = time.perf_counter()
                        _poison(outs)
                        t1p = time.perf_counter()
                        gs = enc.get_many(keys, outs)
                        t2 = time.perf_counter()
                        if ps != [Status.OK] * blocks or gs != [Status.OK] * blocks or not _equal(outs, datas):
                            result["warnings"].append(f"sealed tier at {mib} MiB: put {ps} get {gs}")
                        rates["sealed_put"].append(blocks * n / (t1 - t0))
                        rates["sealed_get"].append(blocks * n / (t2 - t1p))
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
                result[f"get_ratio_vs_mooncake_{tag}"] = round(med["kvtier_get"] / med["bare_get"], 3)
                result[f"put_ratio_vs_mooncake_{tag}"] = round(med["kvtier_put"] / med["bare_put"], 3)
                # the median of each run's own ratio: a shared machine's load drifts between runs,
                # and a pair timed back to back sees the same load
                for op in ("get", "put"):
                    result[f"{op}_ratio_vs_mooncake_paired_{tag}"] = round(statistics.median(
                        k / b for k, b in zip(rates[f"kvtier_{op}"], rates[f"bare_{op}"])), 3)
                result[f"get_ratio_vs_socket_{tag}"] = round(med["kvtier_get"] / med["socket"], 3)
                result[f"put_ratio_vs_socket_{tag}"] = round(med["kvtier_put"] / med["socket"], 3)
                result[f"bare_get_ratio_vs_socket_{tag}"] = round(med["bare_get"] / med["socket"], 3)
                result[f"bare_put_ratio_vs_socket_{tag}"] = round(med["bare_put"] / med["socket"], 3)
                if enc is not None:
                    result[f"sealed_get_ratio_vs_plain_{tag}"] = round(med["sealed_get"] / med["kvtier_get"], 3)
                    result[f"sealed_put_ratio_vs_plain_{tag}"] = round(med["sealed_put"] / med["kvtier_put"], 3)
                    result[f"aes_gcm_gbs_{tag}"] = round(_aes_rate(datas[0]) / 1e9, 3)
        finally:
            if enc is not None:
                enc.close()
            tier.close()
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return result


def _poison(bufs) -> None:
    for b in bufs:
        b.fill(0xA5)


def _equal(outs, datas) -> bool:
    return all(np.array_equal(o, d) for o, d in zip(outs, datas))
