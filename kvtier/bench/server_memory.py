"""``kvtier bench server-memory``: how much of a server's pool holds payload.

A real ``kvtier serve`` (``--capacity 1GiB --max-block 32MiB`` by default, host
tier only) is filled through a :class:`~kvtier.tiers.remote.RemoteTier` until
its host tier evicts for the first time (the admin STATS are read after every
put). ``payload_efficiency`` is the payload bytes the server then holds (its
index: what a client can still get) divided by the pool's capacity. Two runs,
each on a fresh server:

* ``payload_efficiency``: every block 256 KiB (the demo's blocks);
* ``payload_efficiency_mixed``: sizes log-uniform between 16 KiB and 32 MiB
  (several models and layouts sharing one server).

Each run then keeps putting for another pool's worth of bytes and reports the
lowest and mean efficiency while evicting (``*_steady_min`` / ``*_steady_mean``),
then reads back a random sample of the blocks the server still lists (verified by
the client, and compared with what was put), so that a full pool is seen to return
what it counts: a block that does not come back stops the bench with
``RuntimeError`` (as the storage and server benches do) instead of posting an
efficiency of bytes the pool does not serve.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import tempfile
import time

import numpy as np

from kvtier.core.units import parse_size
from kvtier.errors import ConfigError
from kvtier.json_files import strict_json

KIB, MIB = 1 << 10, 1 << 20
#: blocks read back after the fill, drawn at random from all the server still lists
READ_BACK_SAMPLE = 64


def _sizes(kind: str, seed: int, max_block: int):
    """Block sizes, none above the server's ``max_block`` (a size above it was put cut short to
    what the source holds, yet counted whole, and read back as the wrong size)."""
    rng = np.random.default_rng(seed)
    lo, hi = math.log(16 * KIB), math.log(32 * MIB)
    while True:
        if kind == "uniform":
            yield min(256 * KIB, max_block)
        else:
            yield min(int(math.exp(rng.uniform(lo, hi))), max_block)


def fill_until_eviction(capacity: int, max_block: int, kind: str, *, seed: int = 0,
                        timeout_s: float = 120.0) -> dict:
    """One fresh server filled with ``kind`` blocks; the efficiency at its first eviction and after."""
    from kvtier.server.launch import ServerProcess
    from kvtier.tiers.base import Status
    from kvtier.tiers.remote import RemoteTier

    token, admin = (hashlib.sha256(os.urandom(16)).hexdigest() for _ in range(2))
    source = np.random.default_rng(seed).integers(0, 256, max_block, dtype=np.uint8)
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-memory-")
    with ServerProcess.start({"bench": token}, admin_token=admin, workdir=workdir,
                             server={"capacity": capacity, "max_block": max_block}) as server:
        tier = RemoteTier(server.url, token, namespace=f"memory-{kind}", timeout_s=60, pool_size=1)
        stats = RemoteTier(server.url, admin, timeout_s=60, pool_size=1)

        def held() -> tuple[int, int, int]:
            """(payload bytes held, host evictions, host capacity) from the server itself."""
            s = stats.server_stats()
            host = s["store"]["tiers"]["host"]
            return sum(u["bytes"] for u in s["usage"].values()), host["evictions"], host["capacity_bytes"]

        sizes = _sizes(kind, seed, max_block)
        put = put_bytes = mark = 0
        first: dict | None = None
        steady: list[float] = []
        placed: dict[bytes, tuple[int, int]] = {}  # key → (offset in source, size) of every put
        t0 = time.perf_counter()
        try:
            while time.perf_counter() - t0 < timeout_s:
                n = next(sizes)
                key = hashlib.sha256(f"{kind}/{put}".encode()).digest()
                offset = (put * 4099) % (max_block - n + 1)  # different bytes per block
                status = tier.put(key, source[offset : offset + n])
                if status is not Status.OK:
                    raise RuntimeError(f"put of a {n}-byte block failed with {status.name}")
                put, put_bytes = put + 1, put_bytes + n
                placed[key] = (offset, n)
                payload, evictions, pool = held()
                if first is None and evictions:
                    first = {"payload_bytes": payload, "blocks_put": put, "bytes_put": put_bytes,
                             "capacity_bytes": pool, "efficiency": payload / pool}
                    mark = put_bytes
                elif first is not None:
                    steady.append(payload / pool)
                    if put_bytes - mark >= pool:
                        break
            if first is None:
                raise RuntimeError(f"the server did not evict within {timeout_s:.0f} s ({put_bytes} bytes put)")
            listed, sample, verified = _read_back(tier, placed, source, random.Random(seed))
        finally:
            tier.close()
            stats.close()
    return {
        "efficiency": round(first["efficiency"], 4),
        "steady_min": round(min(steady), 4) if steady else None,
        "steady_mean": round(sum(steady) / len(steady), 4) if steady else None,
        "blocks_at_first_eviction": first["blocks_put"],
        "payload_at_first_eviction": first["payload_bytes"],
        "capacity_bytes": first["capacity_bytes"],
        "blocks_put": put,
        "blocks_listed": listed,
        "read_back_verified": f"{verified}/{sample}",
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _read_back(tier, placed: dict[bytes, tuple[int, int]], source: np.ndarray,
               rng: random.Random) -> tuple[int, int, int]:
    """Read back up to :data:`READ_BACK_SAMPLE` blocks drawn from all the server lists (not only the
    newest, the least likely to have been lost), each verified by the client and compared with the
    bytes put. Returns (blocks listed, blocks read, blocks verified); raises ``RuntimeError`` unless
    the server lists blocks, all of them put here, and every one read comes back."""
    from kvtier.tiers.base import Status

    listed = [bytes(k) for k in tier.keys()]
    unknown = sum(k not in placed for k in listed)
    if not listed or unknown:
        raise RuntimeError(f"the server lists {len(listed)} blocks ({unknown} never put) after "
                           f"{len(placed)} puts; no efficiency is posted for an index the pool cannot be seen to serve")
    failed = []
    sample = rng.sample(listed, min(READ_BACK_SAMPLE, len(listed)))
    for key in sample:
        offset, n = placed[key]
        out = np.empty(n, np.uint8)
        status = tier.get(key, out)
        if status is not Status.OK or not np.array_equal(out, source[offset : offset + n]):
            failed.append(status.name if status is not Status.OK else "other bytes")
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(sample)} blocks the server lists did not read back "
                           f"({', '.join(sorted(set(failed)))}): the index counts bytes the pool does not serve; "
                           f"no efficiency is posted")
    return len(listed), len(sample), len(sample)


def run(capacity: int, max_block: int, seed: int = 0) -> dict:
    uniform = fill_until_eviction(capacity, max_block, "uniform", seed=seed)
    mixed = fill_until_eviction(capacity, max_block, "mixed", seed=seed)
    return {
        "capacity_bytes": capacity,
        "max_block_bytes": max_block,
        "payload_efficiency": uniform["efficiency"],
        "payload_efficiency_mixed": mixed["efficiency"],
        "payload_efficiency_steady_min": uniform["steady_min"],
        "payload_efficiency_mixed_steady_min": mixed["steady_min"],
        "uniform_256KiB": uniform,
        "mixed_16KiB_32MiB": mixed,
    }


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "server-memory", help="payload held by a kvtier serve pool when it starts evicting (uniform and mixed sizes)")
    p.add_argument("--capacity", default="1GiB", help="the server's host pool (default 1GiB)")
    p.add_argument("--max-block", default="32MiB", help="the server's largest block (default 32MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _main(args) -> int:
    capacity, max_block = parse_size(args.capacity, "--capacity"), parse_size(args.max_block, "--max-block")
    # the server would refuse these at its start, which the bench reported as a traceback
    if max_block < 1 or capacity < max_block:
        raise ConfigError(f"--capacity ({capacity} bytes) must hold at least one block of --max-block "
                          f"({max_block} bytes)")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    result = run(capacity, max_block, args.seed)
    if args.json:
        print(strict_json(result))
    else:
        for k, v in result.items():
            print(f"{k:>36}: {v}")
    return 0
