"""An embedded store says, once per process, when it writes outside the process in plaintext or keys
every user under the default tenant."""

from __future__ import annotations

import logging

import pytest

from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.store import safety
from kvtier.store.config import StoreConfig, build_store
from kvtier.store.context import ContextCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch, caplog):
    """Each test is a new process as far as "once" goes; no master key unless the test sets one."""
    monkeypatch.setattr(safety, "_said", set())
    monkeypatch.delenv("KVTIER_MASTER_KEY", raising=False)
    caplog.set_level(logging.WARNING, logger="kvtier")


def warnings(caplog, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and word in r.getMessage()]


def test_a_disk_tier_without_a_master_key_is_announced_once(tmp_path, caplog):
    for i in range(3):
        build_store(StoreConfig(host_bytes=0, disk_path=str(tmp_path / f"d{i}"), tenant="acme"), LAYOUT).close()
    said = warnings(caplog, "UNENCRYPTED")
    assert len(said) == 1, said
    assert "disk tier" in said[0] and "KVTIER_MASTER_KEY" in said[0] and "master_key_file" in said[0]


def test_a_remote_tier_without_a_master_key_is_announced_and_the_url_is_not_logged(caplog):
    url = "tcp://127.0.0.1:9/ns?token=secret-token"
    build_store(StoreConfig(host_bytes=0, remote_url=url, tenant="acme"), LAYOUT).close()
    said = warnings(caplog, "UNENCRYPTED")
    assert len(said) == 1 and "remote tier" in said[0]
    assert "secret-token" not in caplog.text


def test_no_plaintext_warning_with_a_master_key_or_without_outer_tiers(tmp_path, caplog, monkeypatch):
    build_store(StoreConfig(host_bytes=4 * LAYOUT.block_nbytes, tenant="acme"), LAYOUT).close()
    monkeypatch.setenv("KVTIER_MASTER_KEY", "11" * 32)
    build_store(StoreConfig(host_bytes=0, disk_path=str(tmp_path / "d"), tenant="acme"), LAYOUT).close()
    assert warnings(caplog, "UNENCRYPTED") == []


def test_the_default_tenant_is_announced_once(tmp_path, caplog):
    build_store(StoreConfig(host_bytes=4 * LAYOUT.block_nbytes), LAYOUT).close()
    store = build_store(StoreConfig(host_bytes=4 * LAYOUT.block_nbytes), LAYOUT)
    ContextCache(store, Namespace("m", LAYOUT))
    store.close()
    said = warnings(caplog, "default tenant")
    assert len(said) == 1, said
    assert "shares key roots" in said[0] and "tenant=" in said[0]


def test_an_embedded_namespace_without_a_tenant_is_announced(caplog):
    store = build_store(StoreConfig(host_bytes=4 * LAYOUT.block_nbytes, tenant="acme"), LAYOUT)
    ContextCache(store, Namespace("m", LAYOUT, tenant="acme"))
    assert warnings(caplog, "default tenant") == []
    ContextCache(store, Namespace("m", LAYOUT))
    assert len(warnings(caplog, "default tenant")) == 1
    store.close()
