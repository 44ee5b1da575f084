"""The Mooncake tier's object tags, without a fleet: what the GMAC binds, and that it is fed in pieces
as it is in one call."""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.core.payload import FLAG_KEYED_MAC, HEADER_NBYTES, unpack_header
from kvtier.tiers.mooncake_names import SALT_BYTES, TenantNaming, header_row, names_block, salt_of


class Naming(TenantNaming):
    def __init__(self, secret: bytes) -> None:
        self._secret = secret


def test_the_tag_binds_secret_name_size_salt_and_every_byte():
    tier = Naming(b"s" * 32)
    digest, salt = tier._digest(b"k" * 32), os.urandom(SALT_BYTES)
    payload = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    tag = tier.payload_tag(digest, salt, payload)
    assert tier.payload_tag(digest, salt, payload.copy()) == tag       # control: the same inputs verify
    flipped = payload.copy()
    flipped[len(flipped) // 2] ^= 1
    others = {
        "a byte": tier.payload_tag(digest, salt, flipped),
        "the secret": Naming(b"t" * 32).payload_tag(digest, salt, payload),
        "the name": tier.payload_tag(tier._digest(b"j" * 32), salt, payload),
        "the salt": tier.payload_tag(digest, os.urandom(SALT_BYTES), payload),
        "the size": tier.payload_tag(digest, salt, payload[:-16]),
    }
    assert all(t != tag for t in others.values()), [w for w, t in others.items() if t == tag]


def test_a_mac_fed_in_pieces_is_aes_gcm_over_the_payload_as_associated_data():
    tier = Naming(b"s" * 32)
    digest, salt = tier._digest(b"k" * 32), os.urandom(SALT_BYTES)
    payload = np.random.default_rng(2).integers(0, 256, (1 << 20) + 12345, dtype=np.uint8)
    mac = tier.payload_mac(digest, payload.nbytes, salt)
    for start in range(0, payload.nbytes, 70001):       # pieces not a multiple of AES's 16 bytes
        mac.update(payload[start:start + 70001])
    pieced = mac.tag()
    assert pieced == tier.payload_tag(digest, salt, payload)
    # GMAC as the standard defines it: AES-GCM of nothing, the payload as associated data
    import hashlib
    import hmac
    key = hmac.new(tier._secret, b"kvtier mooncake gmac key\0" + digest + payload.nbytes.to_bytes(8, "little") + salt,
                   hashlib.sha256).digest()
    assert pieced == AESGCM(key).encrypt(bytes(12), b"", payload.tobytes())


def test_each_header_row_has_a_fresh_salt_and_names_its_block():
    tier = Naming(b"s" * 32)
    digest = tier._digest(b"k" * 32)
    payload = np.arange(4096, dtype=np.uint8)
    rows = [unpack_header(header_row(tier, digest, payload, None)) for _ in range(2)]
    assert rows[0].flags & FLAG_KEYED_MAC and all(names_block(h, digest, payload.nbytes) for h in rows)
    assert salt_of(rows[0]) != salt_of(rows[1]) and rows[0].checksum != rows[1].checksum
    assert all(h.checksum == tier.payload_tag(digest, salt_of(h), payload) for h in rows)
    assert not names_block(rows[0], tier._digest(b"j" * 32), payload.nbytes)
    assert not names_block(rows[0], digest, payload.nbytes + 1)
    assert len(header_row(tier, digest, payload, None)) == HEADER_NBYTES


def test_the_tier_refuses_non_finite_deadlines_before_connecting(monkeypatch):
    import pytest

    from kvtier.tiers import mooncake as mc

    class Connected(Exception):
        pass

    def no_engine(*a, **k):
        raise Connected("the checks passed: the tier went on to connect")

    monkeypatch.setattr(mc.SharedClient, "acquire", no_engine)
    for field, value in (("timeout_s", float("inf")), ("timeout_s", float("nan")), ("timeout_s", 0),
                         ("min_rate_bytes_s", float("nan")), ("min_rate_bytes_s", float("inf"))):
        with pytest.raises(ValueError, match="finite and positive"):
            mc.MooncakeTier("127.0.0.1:1", tenant="acme", secret=b"s" * 32, **{field: value})
    with pytest.raises(Connected):  # control: finite positive values pass the checks
        mc.MooncakeTier("127.0.0.1:1", tenant="acme", secret=b"s" * 32, timeout_s=1.5, min_rate_bytes_s=1e6)
