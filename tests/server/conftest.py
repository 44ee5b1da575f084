"""Fixtures: real ``kvtier serve`` processes on loopback / Unix sockets, and raw-protocol helpers."""

from __future__ import annotations

import hashlib
import socket
import time

import numpy as np
import pytest

from kvtier.server.launch import ServerProcess
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import HEADER_NBYTES, Op, pack_header, pack_msgpack, unpack_header
from tests.server.events_keys import EventsKeys
from tests.server.harness import SHARED, TOKENS, fresh_namespace, tenants

BLOCK = 64 * 1024
#: KV-events credentials of the ``server`` fixture: a router that sees every tenant, and acme's own
EVENTS_KEYS = EventsKeys({"router": "*", "acme": "acme"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A full-featured server: TCP + Unix, metrics, KV events with replay, audit log."""
    wd = tmp_path_factory.mktemp("kvtier-serve")
    srv = ServerProcess.start(
        tenants(), shared=SHARED, admin_token=TOKENS["admin"], unix=True, workdir=str(wd),
        server={
            "capacity": "64MiB", "max_block": "1MiB", "metrics": "127.0.0.1:0",
            **EVENTS_KEYS.server_config(),
            "audit_log": str(wd / "audit.jsonl"), "sweep_interval_s": 0.1,
        },
        env=EVENTS_KEYS.server_env(),
    )
    yield srv
    srv.stop()


def remote(srv: ServerProcess, who: str = "acme", namespace: str | None = None, **kw) -> RemoteTier:
    return RemoteTier(srv.tcp_url, TOKENS[who], namespace=namespace or fresh_namespace(), **kw)


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def block(key: bytes, nbytes: int = BLOCK) -> np.ndarray:
    """Bytes derived from the key: any reader can check what it got."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


# -- raw protocol -----------------------------------------------------------------------------
def connect(url: str, timeout: float = 5.0) -> socket.socket:
    if url.startswith("unix://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(url[len("unix://") :])
    else:
        host, port = url[len("tcp://") :].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=timeout)
    return s


def frame(op: int, meta: bytes = b"", data: bytes = b"", req_id: int = 1, data_len: int | None = None) -> bytes:
    return pack_header(op, req_id, len(meta), len(data) if data_len is None else data_len) + meta + data


def hello_frame(token: str, namespace: str = "default", **extra) -> bytes:
    return frame(Op.HELLO, pack_msgpack({"token": token, "namespace": namespace, **extra}))


def logged_in(url: str, token: str, namespace: str = "default") -> socket.socket:
    """A raw connection past its HELLO (asserted accepted)."""
    s = connect(url)
    s.sendall(hello_frame(token, namespace))
    h, meta, _ = read_frame(s)
    assert h.code == 0, (h, meta)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


def read_frame(s: socket.socket):
    h = unpack_header(recv_exact(s, HEADER_NBYTES))
    meta = recv_exact(s, h.meta_len) if h.meta_len else b""
    data = recv_exact(s, h.data_len) if h.data_len else b""
    return h, meta, data


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True once the server has closed the connection (EOF or reset)."""
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False
