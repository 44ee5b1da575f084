"""``kvtier bench remote --target mooncake``: MooncakeTier against the bare Mooncake client and raw TCP.

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
* ``socket``: the raw TCP loopback limit, Mooncake's transport here: a peer process that only
  moves bytes (:class:`~kvtier.bench.remote.RawPeer`, ``TCP_NODELAY``, as the server bench's
  limit) is sent the same distinct ``blocks`` buffers (``socket_put``) and sends them back into
  the same distinct outs (``socket_get``, poisoned first and verified).

Every round's gets are checked (outs poisoned before, compared after, untimed): a put that
failed or a get that missed or returned other bytes stops the bench with ``RuntimeError`` (as
the storage and server benches do) instead of posting the rate of a transfer that did not
happen. Ratios against the socket and the bare client, and the sealed tier's against the plain
one, above :data:`~kvtier.bench.baselines.RATIO_WARN_ABOVE` are said in ``warnings``: the baseline
is wrong.

Medians of ``runs`` at the largest size and proportionally more at smaller ones (``runs_per_size``:
every size's median rests on the same bytes moved; a 4 x 8 MiB phase lasts ~18 ms, and 7 of them
swung 0.73-0.91 between quiet runs); ratios are of medians of the same run set (``*_paired``: the median of
each run's own kvtier/bare ratio, the steadier figure on a shared machine).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from kvtier.bench.baselines import ratio_warnings
from kvtier.bench.remote import RawPeer
from kvtier.errors import ConfigError
from kvtier.tiers.base import Status

#: the byte gets' outs are filled with before each get (untimed): a get that writes nothing fails its check
POISON = 0xA5


def _verify(what: str, moved: bool, detail, outs: list[np.ndarray], datas: list[np.ndarray]) -> None:
    """Stop the bench when a round did not move its bytes (its rate would be of nothing): the
    statuses (``moved`` False, ``detail`` says them), or an out that differs from what was put."""
    if not moved:
        raise RuntimeError(f"{what}: {detail}; no rate is posted for a round that did not move its bytes")
    for i, (got, want) in enumerate(zip(outs, datas)):
        if not np.array_equal(got, want):
            state = "was never written (still poisoned)" if np.all(got == POISON) else "holds other bytes than were put"
            raise RuntimeError(f"{what}: get of block {i} reported success but the buffer {state}")


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
            chunk = data[lo:lo + DEFAULT_CHUNK_BYTES]   # a block under a chunk, or its last piece: shorter
            aead.encrypt_into(nonce, chunk, None, out[:chunk.nbytes + 16])
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

    if runs < 1:
        # before the cluster starts: with no run, the medians are empty (a KeyError after the start)
        raise ConfigError(f"runs must be at least 1, got {runs}")
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
        peer = None
        try:
            # the socket limit: TCP loopback to a peer process, with room for a phase of the largest blocks
            peer = RawPeer(None, int(max(sizes_mib) * (1 << 20)) * blocks)
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
                                                  "sealed_put", "sealed_get", "socket_put", "socket_get")}
                for run_i in range(runs_per_size[mib]):
                    names = [f"bench/{mib}/{run_i}/{i}" for i in range(blocks)]
                    keys = [int(mib * 1000 + run_i * blocks + i).to_bytes(32, "big") for i in range(blocks)]
                    codes, got, put_s, get_s = _timed_round(
                        lambda: engine.batch_put_from(names, [d.ctypes.data for d in datas], [n] * blocks),
                        lambda: engine.batch_get_into(names, [o.ctypes.data for o in outs], [n] * blocks), outs)
                    _verify(f"bare client at {mib} MiB", not any(codes) and all(g == n for g in got),
                            f"put {codes} get {got}", outs, datas)
                    rates["bare_put"].append(blocks * n / put_s)
                    rates["bare_get"].append(blocks * n / get_s)
                    snames = [f"bench-session/{mib}/{run_i}/{i}" for i in range(blocks)]
                    codes, got, put_s, get_s = _timed_round(lambda: bare_session.put(snames, datas),
                                                            lambda: bare_session.get(snames, outs), outs)
                    _verify(f"bare client in a session at {mib} MiB", not any(codes) and all(g == n for g in got),
                            f"put {codes} get {got}", outs, datas)
                    rates["bare_session_put"].append(blocks * n / put_s)
                    rates["bare_session_get"].append(blocks * n / get_s)
                    engine.batch_remove(snames, True)
                    ps, gs, put_s, get_s = _timed_round(lambda: tier.put_many(keys, datas),
                                                        lambda: tier.get_many(keys, outs), outs)
                    _verify(f"kvtier tier at {mib} MiB", ps == gs == [Status.OK] * blocks, f"put {ps} get {gs}",
                            outs, datas)
                    rates["kvtier_put"].append(blocks * n / put_s)
                    rates["kvtier_get"].append(blocks * n / get_s)
                    if enc is not None:
                        ps, gs, put_s, get_s = _timed_round(lambda: enc.put_many(keys, datas),
                                                            lambda: enc.get_many(keys, outs), outs)
                        _verify(f"sealed tier at {mib} MiB", ps == gs == [Status.OK] * blocks, f"put {ps} get {gs}",
                                outs, datas)
                        rates["sealed_put"].append(blocks * n / put_s)
                        rates["sealed_get"].append(blocks * n / get_s)
                        # the reads' leases refuse a plain removal: force, so the segment never fills
                        engine.batch_remove([enc.inner.storage_name(enc.storage_name(k)) for k in keys], True)
                    _, _, put_s, get_s = _timed_round(lambda: peer.put(datas), lambda: peer.get(outs), outs)
                    _verify(f"raw TCP socket at {mib} MiB", True, "", outs, datas)
                    rates["socket_put"].append(blocks * n / put_s)
                    rates["socket_get"].append(blocks * n / get_s)
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
                for op in ("get", "put"):
                    result[f"{op}_ratio_vs_socket_{tag}"] = round(med[f"kvtier_{op}"] / med[f"socket_{op}"], 3)
                    result[f"bare_{op}_ratio_vs_socket_{tag}"] = round(med[f"bare_{op}"] / med[f"socket_{op}"], 3)
                # above 1.05 the baseline is wrong (not the transport, memory or calls the tier had)
                result["warnings"] += ratio_warnings(
                    {k: v for k, v in result.items() if k.endswith(f"_{tag}") and "_ratio_vs_socket_" in k},
                    what="raw TCP loopback socket limit")
                result["warnings"] += ratio_warnings(
                    {k: v for k, v in result.items() if k.endswith(f"_{tag}") and "_ratio_vs_mooncake" in k},
                    what="bare Mooncake client")
                if enc is not None:
                    result[f"sealed_get_ratio_vs_plain_{tag}"] = round(med["sealed_get"] / med["kvtier_get"], 3)
                    result[f"sealed_put_ratio_vs_plain_{tag}"] = round(med["sealed_put"] / med["kvtier_put"], 3)
                    # sealing only adds work to the plain tier's: faster than it, the plain figure is wrong
                    result["warnings"] += ratio_warnings(
                        {f"sealed_{op}_ratio_vs_plain_{tag}": result[f"sealed_{op}_ratio_vs_plain_{tag}"]
                         for op in ("get", "put")},
                        what="plain MooncakeTier (the same transfer without sealing)")
                    result[f"aes_gcm_gbs_{tag}"] = round(_aes_rate(datas[0]) / 1e9, 3)
        finally:
            if peer is not None:
                peer.close()
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
        b.fill(POISON)
