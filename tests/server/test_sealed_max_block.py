"""A server's ``max_block`` sized with ``kvtier.crypto.aead.sealed_stream_nbytes`` (what README and
SECURITY.md tell an operator) holds exactly the blocks an engine seals end to end: the largest
plaintext block fits, one byte more does not. (They once named ``sealed_nbytes``, whose 2 MiB
default chunks count a quarter of the tags a 512 KiB sealed stream carries.)"""

from __future__ import annotations

import os

import numpy as np

from kvtier.crypto import aead
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import TOKENS

PLAIN = 2 << 20   # the largest block the engine stores: four 512 KiB stream chunks


def test_max_block_sized_with_sealed_stream_nbytes_takes_the_largest_sealed_block(tmp_path):
    max_block = aead.sealed_stream_nbytes(PLAIN)
    assert max_block > aead.sealed_nbytes(PLAIN)   # the function the docs named before: too little room
    srv = ServerProcess.start({"acme": TOKENS["acme"]}, workdir=str(tmp_path),
                              server={"capacity": "16MiB", "max_block": max_block})
    try:
        keyring = Keyring(StaticMasterKey(os.urandom(32)), tmp_path / "keys", refresh_s=0.0)
        tier = EncryptedTier(remote(srv, "acme"), keyring, "acme")   # chunks as an engine's: the default
        assert tier.chunk_bytes == aead.STREAM_CHUNK_BYTES
        largest, over = keys_for("sealed-max-block", 2)
        assert tier.put(largest, block(largest, PLAIN)) is Status.OK
        out = np.zeros(PLAIN, np.uint8)
        assert tier.get(largest, out) is Status.OK and np.array_equal(out, block(largest, PLAIN))
        assert tier.put(over, block(over, PLAIN + 1)) is not Status.OK   # a 5th chunk: 17 bytes more
        tier.close()
    finally:
        srv.stop()
