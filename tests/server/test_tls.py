"""TLS on TCP: the same protocol inside TLS; a client that does not trust the certificate gets a miss."""

from __future__ import annotations

import datetime
import os
import ipaddress

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import block, keys_for
from tests.server.harness import SHARED, TOKENS, tenants


def _self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)  # the server refuses a private key others may read
    return str(cert_path), str(key_path)


def test_tls_round_trip_and_untrusted_certificate(tmp_path):
    cert, key = _self_signed(tmp_path)
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), tcp=False, server={
        "listen": ["tls://127.0.0.1:0"], "tls_cert": cert, "tls_key": key, "capacity": "16MiB", "max_block": "1MiB",
    }) as srv:
        assert srv.url.startswith("tls://")
        tier = RemoteTier(f"{srv.url}?ca={cert}", TOKENS["acme"], namespace="tls")
        keys = keys_for("tls", 3)
        data = [block(k, 300_000) for k in keys]
        assert tier.put_many(keys, data) == [Status.OK] * 3
        outs = [np.zeros(300_000, np.uint8) for _ in keys]
        assert tier.get_many(keys, outs) == [Status.OK] * 3
        assert all(np.array_equal(a, b) for a, b in zip(outs, data))
        untrusting = RemoteTier(srv.url, TOKENS["acme"], namespace="tls", timeout_s=2)
        assert untrusting.lookup_prefix(keys) == 0
        assert "CERTIFICATE" in (untrusting.last_error or "").upper()
