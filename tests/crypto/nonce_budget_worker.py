"""One process of the shared-nonce-budget tests (``python -m tests.crypto.nonce_budget_worker``).

It seals blocks through a real ``EncryptedTier`` over a host pool, with a ``Keyring`` over a
key store directory other processes share, and reports what the *ciphertext* says: for each
block, one JSON line with the epoch and key id in its sealed header and its chunk count (the
AES-GCM invocations made under that key). So the test counts encryptions from what was
sealed, not from the keyring's own bookkeeping.

Modes:
  seal STORE BOUND LEASE ENCRYPTIONS   print "ready", wait for a line on stdin, then seal
                                       blocks until ENCRYPTIONS chunks are sealed
  hold STORE BOUND LEASE BLOCKS        seal BLOCKS blocks, print this process's lease, then
                                       sleep until killed (a crash in the middle of a lease)
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.crypto import aead
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier

MASTER = StaticMasterKey(bytes(range(32)))
TENANT = "acme"
CHUNK = 64
PLAIN = 3 * CHUNK  # 3 encryptions a block: leases (64) are not a multiple of a block's need
SEALED = aead.sealed_nbytes(PLAIN, CHUNK)


def keyring(store: str, bound: int, lease: int) -> Keyring:
    return Keyring(MASTER, store, rotate_after=bound, lease_size=lease)


def seal_one(tier: EncryptedTier, host: HostTier, i: int, out: np.ndarray) -> dict:
    key = BlockKey(os.getpid().to_bytes(8, "big") + i.to_bytes(24, "big"))
    plain = np.random.default_rng(i).integers(0, 256, PLAIN, dtype=np.uint8)
    assert tier.put(key, plain).name == "OK"
    name = tier.storage_name(key)
    assert host.get(name, out).name == "OK"  # the sealed bytes, as stored
    header = aead.parse_header(out)
    host.delete(name)  # (keeps the pool small; the count is taken)
    return {"pid": os.getpid(), "epoch": header.epoch, "key_id": header.key_id.hex(), "chunks": header.n_chunks}


def main(argv: list[str]) -> None:
    mode, store, bound, lease, amount = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    keys = keyring(store, bound, lease)
    host = HostTier(64 * 4096, 4096, prefault=False)
    tier = EncryptedTier(host, keys, TENANT, chunk_bytes=CHUNK, threads=1, streams=1)
    out = np.empty(SEALED, dtype=np.uint8)
    if mode == "seal":
        print("ready", flush=True)
        sys.stdin.readline()  # all processes start together
        sealed, i = 0, 0
        lines = []
        while sealed < amount:
            line = seal_one(tier, host, i, out)
            lines.append(json.dumps(line))
            sealed += line["chunks"]
            i += 1
        print("\n".join(lines), flush=True)
    elif mode == "hold":
        for i in range(amount):
            print(json.dumps(seal_one(tier, host, i, out)), flush=True)
        held = keys.lease(TENANT)
        print(json.dumps({"lease": {"epoch": held.epoch, "start": held.start, "end": held.end,
                                    "remaining": held.remaining}}), flush=True)
        time.sleep(3600)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
