"""A caller's mistake is the caller's ValueError, not a server outage.

A session id over MAX_SESSION_BYTES was found out while the put held a connection: taken for a
failure of the server, it closed a healthy connection, put the tier into backoff (every thread's
calls failed at once, for seconds) and the put answered Status.ERROR.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.core.payload import BlockMeta
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import block, keys_for
from tests.server.harness import TOKENS, fresh_namespace, shared_server


@pytest.mark.parametrize("mistake", [{"session": "s" * 65}, {"meta": BlockMeta(shape=(1,) * 7)}])
def test_a_bad_put_argument_raises_and_leaves_the_tier_available(mistake):
    srv = shared_server()
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=fresh_namespace("mistake"), backoff_s=5.0,
                      max_backoff_s=5.0)
    keys = keys_for(f"mistake-{sorted(mistake)[0]}", 3)
    try:
        assert tier.put(keys[0], block(keys[0], 4096)) is Status.OK
        with pytest.raises(ValueError):
            tier.put(keys[1], block(keys[1], 4096), **mistake)
        assert tier.available, tier.last_error
        assert tier.put(keys[2], block(keys[2], 4096)) is Status.OK
    finally:
        tier.close()


# -- streams: a caller's PayloadSource / PayloadSink breaking its contract (s32 a9 D3) ------------
# send_put_stream found a source's wrong length while the put held a connection (and a sink's
# nbytes no frame can carry was packed there): taken for a server failure, the tier went into
# backoff, every thread's calls failed for seconds, and the caller got Status.ERROR, never its error.
class _Source:
    """A sealed payload's source that announces ``nbytes`` and yields ``pieces``."""

    def __init__(self, nbytes, pieces) -> None:
        self.nbytes = nbytes
        self._pieces = pieces

    def pieces(self):
        for piece in self._pieces:
            if isinstance(piece, Exception):
                raise piece
            yield piece


class _Sink:
    """A sink that takes the payload in one buffer (``piece``: what it yields instead) and finds it good."""

    def __init__(self, nbytes, piece=None) -> None:
        self.nbytes = nbytes
        self.buf = bytearray(nbytes if isinstance(nbytes, int) and nbytes > 0 else 0)
        self._piece = piece

    def pieces(self):
        piece = memoryview(self.buf) if self._piece is None else self._piece
        if isinstance(piece, Exception):
            raise piece
        yield piece
        return None


def _bytes(n: int, fill: int = 7) -> memoryview:
    return memoryview(bytearray([fill]) * n)


def _stream_tier(tag: str) -> RemoteTier:
    srv = shared_server()
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=fresh_namespace(tag), backoff_s=5.0, max_backoff_s=5.0)
    assert tier.streams_available()
    return tier


@pytest.mark.parametrize("source", [
    _Source(4096, [_bytes(2048)]),  # fewer bytes than announced
    _Source(2048, [_bytes(2048), _bytes(2048)]),  # more
    _Source(4096, [_bytes(1024), RuntimeError("the sealing failed")]),  # its own exception, mid-frame
    _Source(4096, ["not a buffer"]),
    _Source(-1, [_bytes(16)]),  # a size no frame can carry
    _Source("4096", [_bytes(4096)]),
], ids=["short", "long", "raises", "not-a-buffer", "negative-size", "size-not-int"])
def test_a_bad_payload_source_raises_and_leaves_the_tier_available(source):
    tier = _stream_tier("bad-source")
    keys = keys_for(f"bad-source-{tier.namespace}", 3)
    try:
        assert tier.put_streams(keys[:1], [_Source(4096, [_bytes(4096)])]) == [Status.OK]
        with pytest.raises(ValueError):
            tier.put_streams(keys[1:2], [source])
        assert tier.available, tier.last_error
        assert tier.put_streams(keys[2:], [_Source(4096, [_bytes(4096)])]) == [Status.OK]
        assert tier.contains_many(keys) == [True, False, True]  # the broken frame stored nothing
    finally:
        tier.close()


@pytest.mark.parametrize("sink", [
    _Sink(-1),  # a size no GET request can carry (packed while the call held a connection)
    _Sink(4096, RuntimeError("the opening failed")),
    _Sink(4096, b"\0" * 4096),  # a read-only buffer: nothing can be received into it
], ids=["negative-size", "raises", "read-only"])
def test_a_bad_payload_sink_raises_and_leaves_the_tier_available(sink):
    tier = _stream_tier("bad-sink")
    keys = keys_for(f"bad-sink-{tier.namespace}", 1)
    try:
        assert tier.put_streams(keys, [_Source(4096, [_bytes(4096, fill=9)])]) == [Status.OK]
        with pytest.raises(ValueError):
            tier.get_streams(keys, [sink])
        assert tier.available, tier.last_error
        good = _Sink(4096)
        assert tier.get_streams(keys, [good]) == [Status.OK]
        assert good.buf == bytearray([9]) * 4096
    finally:
        tier.close()


# -- an encrypted tier's own sink breaking is no mistake of its caller's (s32 r7, possible issue) --
# With an EncryptedTier over a RemoteTier, a keyring that could not read its key file raised from
# inside the opening sink: the remote tier took it for a caller's broken sink (CallerError), and
# it escaped TieredStore.get, whose misses never raise.
def test_a_key_file_that_cannot_be_read_is_an_error_miss_of_the_store_and_the_remote_tier_stays_up(tmp_path):
    master, keys_dir = StaticMasterKey(bytes(range(32))), tmp_path / "keys"
    # a new data key (epoch) for each block
    writer = EncryptedTier(_stream_tier("sealed-writer"), Keyring(master, keys_dir, rotate_after=1, lease_size=1),
                           "acme", chunk_bytes=4096)
    inner = RemoteTier(shared_server().tcp_url, TOKENS["acme"], namespace=writer.inner.namespace, backoff_s=5.0,
                       max_backoff_s=5.0)
    # another process's keyring: it reads the key file again only for a key it has not seen (each
    # time one is asked for: missing_reload_s=0)
    reader = EncryptedTier(inner, Keyring(master, keys_dir, refresh_s=600.0, missing_reload_s=0.0), "acme",
                           chunk_bytes=4096)
    store = TieredStore([reader])
    keys = keys_for(f"sealed-{inner.namespace}", 3)
    outs = [np.zeros(4096, np.uint8) for _ in keys]
    try:
        assert writer.put_many(keys[:1], [block(keys[0], 4096)]) == [Status.OK]
        assert store.get(keys[:1], outs[:1]).statuses == [Status.OK]  # the reader has the keys of then
        assert writer.put_many(keys[1:2], [block(keys[1], 4096)]) == [Status.OK]  # under a key new to it
        names = [reader.storage_name(k) for k in keys[:2]]
        (key_file,) = (f for f in keys_dir.glob("*.json") if f.name != "keystore-check.json")  # acme's keys
        key_file.unlink()
        key_file.mkdir()  # reading it fails: IsADirectoryError
        got = store.get(keys[1:2], outs[1:2])  # raised CallerError
        assert got.statuses == [Status.ERROR] and got.loaded == 0
        # r8 D1: the failed re-read had dropped the keys the reader held, and the next get's keyring
        # call (the storage name) was made outside the sinks: every later get raised, in every thread
        assert store.get(keys[1:2], outs[1:2]).statuses == [Status.ERROR]  # raised IsADirectoryError
        assert store.get(keys[:1], outs[:1]).statuses == [Status.OK]  # under a key it holds: raised too
        assert (outs[0] == block(keys[0], 4096)).all()
        # a put needs a lease from the key file: ERROR, not an exception
        assert reader.put_many(keys[2:], [block(keys[2], 4096)]) == [Status.ERROR]
        assert inner.available, inner.last_error  # the server and the connection were fine
        assert inner.contains_many(names) == [True, True]  # nothing thrown away
    finally:
        store.close()
        writer.close()
