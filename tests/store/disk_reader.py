"""A separate process that opens a disk tier alone and reads blocks back into poisoned buffers.

    python -m tests.store.disk_reader DIR CAPACITY_BYTES < request.json

``request.json``: ``{"blocks": [[key_hex, nbytes], ...]}``. Prints one JSON line:
``{"digests": {key_hex: sha256_hex or null}}`` -- null for a block the tier did
not return OK. Buffers are filled with 0xA5 before each get, so a get that
reports OK without writing the bytes gives a wrong digest, not a pass.
Nothing crosses the process boundary but JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier

POISON = 0xA5


def main() -> None:
    directory, capacity = sys.argv[1], int(sys.argv[2])
    request = json.load(sys.stdin)
    digests = {}
    with DiskTier(directory, capacity) as disk:
        for key_hex, nbytes in request["blocks"]:
            out = np.full(nbytes, POISON, np.uint8)
            status = disk.get(bytes.fromhex(key_hex), out)
            digests[key_hex] = hashlib.sha256(out).hexdigest() if status is Status.OK else None
    print(json.dumps({"digests": digests}))


if __name__ == "__main__":
    main()
