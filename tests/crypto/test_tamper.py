"""Tamper suite: every manipulation of a sealed block is rejected (0 accepted).

Blocks are sealed both ways (whole, :func:`aead.seal_into`, and chunk by chunk,
:class:`aead.SealingSource`), and every block is opened both ways (whole and by
an :class:`aead.OpeningSink` fed as a streaming tier feeds it): the two openers
must agree on every input.
"""

import os
import random

import numpy as np
import pytest

from kvtier.crypto import aead

CHUNK = 64 * 1024
PLAIN = 5 * CHUNK + 123  # several chunks and a short last one


@pytest.fixture(params=["whole", "stream"])
def sealed(keyring, request):
    key = keyring.key_for_write("acme")
    plain = np.frombuffer(os.urandom(PLAIN), np.uint8)
    args = dict(epoch=key.epoch, key_id=key.key_id, storage_key=b"S" * 32, context=b"acme", plain=plain,
                chunk_bytes=CHUNK)
    if request.param == "whole":
        out = bytearray(aead.sealed_nbytes(PLAIN, CHUNK))
        aead.seal_into(key.aead, out=out, **args)
        return plain, bytes(out)
    source = aead.SealingSource(key.aead, scratch=bytearray(aead.stream_buffer_nbytes(CHUNK)), **args)
    return plain, b"".join(bytes(piece) for piece in source.pieces())


def opener(keyring, tenant="acme"):
    def lookup(epoch, key_id):
        k = keyring.key_for_read(tenant, epoch, key_id)
        return k.aead if k else None

    return lookup


def feed(sink, blob: bytes) -> str | None:
    """What a streaming tier does: a block of another size is refused, else each piece is filled in turn."""
    if len(blob) != sink.nbytes:
        return "size differs"
    pieces, pos = sink.pieces(), 0
    try:
        view = next(pieces)
        while True:
            view[:] = blob[pos : pos + len(view)]
            pos += len(view)
            view = next(pieces)
    except StopIteration as done:
        return done.value


def try_open(keyring, blob, *, storage_key=b"S" * 32, context=b"acme", nbytes=PLAIN, tenant="acme"):
    out = np.empty(nbytes, np.uint8)
    why = aead.open_into(opener(keyring, tenant), storage_key=storage_key, context=context, sealed=blob, out=out)
    streamed = np.empty(nbytes, np.uint8)
    sink = aead.OpeningSink(opener(keyring, tenant), storage_key=storage_key, context=context, out=streamed,
                            scratch=bytearray(aead.stream_buffer_nbytes(CHUNK)), chunk_bytes=CHUNK)
    why_streamed = feed(sink, blob)
    assert (why is None) == (why_streamed is None), (why, why_streamed)
    assert why is not None or np.array_equal(out, streamed)
    return why, out


def test_untouched_block_opens(keyring, sealed):
    plain, blob = sealed
    why, out = try_open(keyring, blob)
    assert why is None and np.array_equal(out, plain)


def test_random_bit_flips_are_all_rejected(keyring, sealed):
    _, blob = sealed
    rng = random.Random(7)
    accepted = 0
    for _ in range(300):
        b = bytearray(blob)
        pos = rng.randrange(len(b))
        b[pos] ^= 1 << rng.randrange(8)
        why, _ = try_open(keyring, bytes(b))
        accepted += why is None
    assert accepted == 0


@pytest.mark.parametrize("cut", [1, 16, aead.TAG_BYTES + 1, CHUNK])
def test_truncation_is_rejected(keyring, sealed, cut):
    _, blob = sealed
    assert try_open(keyring, blob[:-cut])[0] is not None


def test_extension_is_rejected(keyring, sealed):
    _, blob = sealed
    assert try_open(keyring, blob + b"\0" * 16)[0] is not None


def test_chunk_reorder_is_rejected(keyring, sealed):
    _, blob = sealed
    h = aead.HEADER_BYTES
    step = CHUNK + aead.TAG_BYTES
    c0, c1 = blob[h : h + step], blob[h + step : h + 2 * step]
    swapped = blob[:h] + c1 + c0 + blob[h + 2 * step :]
    assert try_open(keyring, swapped)[0] is not None


def test_moved_to_another_key_is_rejected(keyring, sealed):
    plain, blob = sealed
    why, out = try_open(keyring, blob, storage_key=b"S" * 32)  # control: under its own key it opens
    assert why is None and np.array_equal(out, plain)
    assert try_open(keyring, blob, storage_key=b"T" * 32)[0] is not None


def test_cross_tenant_swap_is_rejected(keyring, sealed):
    plain, blob = sealed
    keyring.key_for_write("other")
    why, out = try_open(keyring, blob, context=b"acme", tenant="acme")  # control: its own tenant opens it
    assert why is None and np.array_equal(out, plain)
    assert try_open(keyring, blob, context=b"other", tenant="other")[0] is not None
    assert try_open(keyring, blob, context=b"other")[0] is not None


def test_replay_under_a_retired_epoch_is_rejected(keyring, sealed):
    _, blob = sealed
    keyring.rotate("acme")
    assert try_open(keyring, blob)[0] is None  # old epochs stay readable until retired
    keyring.retire("acme", 0)
    assert "retired or shredded" in try_open(keyring, blob)[0]


def test_header_epoch_rewrite_is_rejected(keyring, sealed):
    _, blob = sealed
    keyring.rotate("acme")
    b = bytearray(blob)
    b[8:12] = (1).to_bytes(4, "little")  # claim the new epoch
    assert try_open(keyring, bytes(b))[0] is not None
