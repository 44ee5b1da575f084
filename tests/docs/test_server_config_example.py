"""The server's documentation, held to the code: the example config heading kvtier/server/config.py
(README sends production users there), ``kvtier serve --help`` and SECURITY.md's sizing and spill
claims. Each test reads the text an operator reads and checks it against the real component."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import zmq

import kvtier.server.config as server_config
from kvtier.cli.main import build_parser
from kvtier.crypto import aead
from kvtier.server.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _config_example() -> str:
    """The TOML after the docstring's ``::``, dedented by its 4 spaces."""
    text = server_config.__doc__.split("::", 1)[1]
    return "\n".join(line[4:] if line.startswith("    ") else line for line in text.splitlines())


def _filled(example: str) -> str:
    """Only the ``<…>`` / ``"..."`` placeholders replaced, each by a value of the kind it asks for
    (every token hash distinct: a token belongs to one tenant)."""
    known = {'"<64 hex digits from `kvtier admin hash-token`>"', '"<hash of a read-only scrape token>"', '"..."',
             '"<z85>"', '"<hex>"', '"<z85 public key>=*"', '"<z85 public key>=acme"'}
    placeholders = set(re.findall(r'"<[^"]*"|"\.\.\."', example))
    assert placeholders <= known, f"placeholders this test cannot fill: {placeholders - known}"
    hashes = iter(hashlib.sha256(str(i).encode()).hexdigest() for i in range(100))
    _, server_secret = zmq.curve_keypair()
    router_public, _ = zmq.curve_keypair()
    acme_public, _ = zmq.curve_keypair()
    example = re.sub(r'"<64 hex digits from `kvtier admin hash-token`>"|"<hash of a read-only scrape token>"|"\.\.\."',
                     lambda _: f'"{next(hashes)}"', example)
    example = example.replace('"<z85>"', f'"{server_secret.decode()}"')
    example = example.replace('"<hex>"', f'"{os.urandom(32).hex()}"')
    example = example.replace('"<z85 public key>=*"', f'"{router_public.decode()}=*"')
    example = example.replace('"<z85 public key>=acme"', f'"{acme_public.decode()}=acme"')
    return example


def test_the_documented_server_config_example_is_accepted(tmp_path, monkeypatch):
    """Written as shown (placeholders filled), `kvtier serve --config` takes the example. It once
    named writer "ops" for its shared namespace, a tenant it never defined: refused at start."""
    path = tmp_path / "kvtier.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # it holds the events secrets
    os.write(fd, _filled(_config_example()).encode())
    os.close(fd)
    monkeypatch.setenv("KVTIER_MASTER_KEY", "00" * 32)   # encrypt_at_rest = true needs a master key
    config = load_config(path, env={})
    assert [t.name for t in config.tenants] == ["acme"]
    assert [(s.name, s.writers) for s in config.shared] == [("system-prompts", ("acme",))]


def test_the_example_shows_every_server_key():
    """Keys the server takes but no document names (sweep_interval_s, the mooncake_* ones) are
    settings an operator cannot find; the example is where the [server] keys are documented."""
    shown = set(re.findall(r"^(\w+) = ", _config_example(), re.MULTILINE))
    server_keys = set(server_config._SERVER_KEYS) - {"admin_token_sha256"}   # that one is [admin] token_sha256
    assert server_keys - shown == set()


def test_max_block_is_not_described_as_a_pool_slot(capsys):
    """The pool has no slabs (each block a run of pages of its own size): "one pool slot" told an
    operator that every block costs max_block of DRAM."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "largest block accepted" in help_text and "pool slot" not in help_text
    assert "pool slot" not in server_config.__doc__


def test_sealed_size_function_named_by_the_docs_gives_the_documented_room():
    """SECURITY.md and README size a server's max_block for end-to-end sealed blocks as "64 bytes
    plus 16 per 512 KiB chunk" and name the function; called as named it must give that room.
    (They named sealed_nbytes, whose 2 MiB default chunk gives a quarter of the tags: a max_block
    sized with it refused the largest sealed blocks.)"""
    security = " ".join((REPO / "SECURITY.md").read_text().split())
    readme = " ".join((REPO / "README.md").read_text().split())
    named = re.search(r"64 bytes plus 16 per 512 KiB chunk \(`kvtier\.crypto\.aead\.(\w+)\(n\)`", security)
    assert named, "SECURITY.md no longer states the formula with the call it names"
    assert f"512 KiB of room for the seal: `kvtier.crypto.aead.{named.group(1)}(n)`" in readme
    for plain in (1, 512 << 10, (512 << 10) + 1, 32 << 20):
        assert getattr(aead, named.group(1))(plain) - plain == 64 + 16 * -(-plain // (512 << 10))


def test_security_md_describes_spill_annotations_as_the_code_writes_them():
    """With encrypt_at_rest the server seals each spill annotation (SpillCodec.for_master_key):
    SECURITY.md said, unscoped, that tenant, namespace and session names are visible on disk."""
    from kvtier.server.spill import SpillAnnotation, SpillCodec

    note = SpillAnnotation(owner="tenant-acme", namespace="ns-secret", key=b"K" * 32, session="session-42",
                           created_wall=1.0, header=b"h", nbytes=1, parent=None)
    sealed = SpillCodec.for_master_key(b"\x01" * 32).pack(b"k" * 32, note)
    assert not any(name in sealed for name in (b"tenant-acme", b"ns-secret", b"session-42"))
    hmaced = SpillCodec(b"\x02" * 32).pack(b"k" * 32, note)
    assert all(name in hmaced for name in (b"tenant-acme", b"ns-secret", b"session-42"))

    security = " ".join((REPO / "SECURITY.md").read_text().split())
    section = security[security.index("**Spilled blocks after a restart.**"):]
    section = section[:section.index("Make a master key")]
    plain_part, _, sealed_part = section.partition("*With `encrypt_at_rest`*")
    assert "*Without `encrypt_at_rest`*" in plain_part and "names are visible on disk" in plain_part
    assert "sealed (AES-256-GCM" in sealed_part and "visible" not in sealed_part

