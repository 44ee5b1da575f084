"""Soak: 32 concurrent clients of two tenants mixing put / get / lookup; every byte read is checked.

Block contents depend on the tenant and the key, so a block served to the wrong
tenant, torn or stale, counts as corrupt. The pool is small, so blocks are
evicted all the time. ``KVTIER_SOAK_S`` sets the duration (default 10 s).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections import Counter

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from tests.server.harness import SHARED, TOKENS, tenants

CLIENTS = 32
DURATION_S = float(os.environ.get("KVTIER_SOAK_S", "10"))
KEYS_PER_TENANT = 400
MAX_BLOCK = 256 * 1024


def _key(i: int) -> bytes:
    return hashlib.sha256(f"soak/{i}".encode()).digest()


def _size(key: bytes) -> int:
    return 4096 * (1 + key[0] % (MAX_BLOCK // 4096))


def _content(tenant: str, key: bytes) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(tenant.encode() + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, _size(key), dtype=np.uint8)


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-soak")
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], unix=True, workdir=str(wd),
                              server={"capacity": "64MiB", "max_block": MAX_BLOCK})
    yield srv
    srv.stop()


def test_soak_32_clients_zero_corrupt_bounded_memory(soak_server):
    keys = [_key(i) for i in range(KEYS_PER_TENANT)]
    expected = {t: {k: _content(t, k) for k in keys} for t in ("acme", "globex")}
    stop = threading.Event()
    lock = threading.Lock()
    counts: Counter = Counter()
    corrupt: list[str] = []
    errors: list[str] = []

    def client(n: int) -> None:
        tenant = "acme" if n % 2 else "globex"
        url = soak_server.unix_url if n % 4 < 2 else soak_server.tcp_url
        tier = RemoteTier(url, TOKENS[tenant], namespace="soak", timeout_s=10, pool_size=1)
        rng = random.Random(n)
        local: Counter = Counter()
        try:
            while not stop.is_set():
                start = rng.randrange(KEYS_PER_TENANT - 8)
                chain = keys[start : start + rng.randint(1, 4)]
                r = rng.random()
                if r < 0.4:
                    for s in tier.put_many(chain, [expected[tenant][k] for k in chain]):
                        local[f"put:{s.name}"] += 1
                elif r < 0.8:
                    outs = [np.empty(_size(k), np.uint8) for k in chain]
                    for k, o, s in zip(chain, outs, tier.get_many(chain, outs)):
                        local[f"get:{s.name}"] += 1
                        if s is Status.OK and not np.array_equal(o, expected[tenant][k]):
                            with lock:
                                corrupt.append(f"{tenant} read wrong bytes for {k.hex()[:12]}")
                else:
                    hit = tier.lookup_prefix(keys[start : start + 8])
                    local["lookup"] += 1
                    local["lookup_hit_blocks"] += hit
                if tier.last_error:
                    with lock:
                        errors.append(tier.last_error)
                    tier.last_error = None
        except Exception as exc:  # noqa: BLE001 - recorded, fails the test below
            with lock:
                errors.append(f"client {n} raised {exc!r}")
        finally:
            tier.close()
            with lock:
                counts.update(local)

    rss0 = soak_server.rss_bytes()
    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for th in threads:
        th.start()
    peak = rss0
    t_end = time.monotonic() + DURATION_S
    while time.monotonic() < t_end:
        time.sleep(0.25)
        peak = max(peak, soak_server.rss_bytes())
    stop.set()
    for th in threads:
        th.join(30)
    peak = max(peak, soak_server.rss_bytes())

    ops = sum(v for k, v in counts.items() if ":" in k) + counts["lookup"]
    print(f"soak: {CLIENTS} clients, {ops} block operations in {DURATION_S:.0f}s, corrupt {len(corrupt)}, "
          f"server RSS {rss0 >> 20} -> peak {peak >> 20} MiB; {dict(counts)}")
    assert corrupt == [], corrupt[:5]
    assert errors == [], errors[:5]
    assert counts["get:OK"] > 100 and counts["put:OK"] > 100
    assert counts["get:MISS"] > 0, "the pool never evicted: the soak is too gentle"
    assert set(k for k in counts if k.startswith(("get:", "put:"))) <= {"get:OK", "get:MISS", "put:OK", "put:FULL"}
    assert peak - rss0 < 64 << 20, f"server memory grew by {(peak - rss0) >> 20} MiB"
    assert soak_server.proc.poll() is None
    check = admin_call(soak_server.tcp_url, TOKENS["admin"], "check", {})
    assert check["ok"] and check["consistent"], check
    # The pool really evicted (a miss alone may be a key never put): the soak exercised eviction.
    host = admin_call(soak_server.tcp_url, TOKENS["admin"], "stats", {})["store"]["tiers"]["host"]
    assert host["evictions"] > 0, host
    assert "Traceback" not in soak_server.log()
