"""Erasure tombstones written under another key (before s32 a disk added to or dropped from the config
switched the key; now one a server does not hold: a secret replaced, a disk dropped before the upgrade)
are logged and not applied, and the quota and TTL overrides of the same file are kept: the start goes
on (it was refused, with "fix or remove the file", which threw the overrides away). Only tombstones of
this key that were edited stop the start. A file from before key ids were kept stops a server with a
disk if it does not authenticate; without a disk it is a dropped disk's: logged and not applied.
(Those not applied stay in the file: test_erasure_tombstones_older_key.py.) The last test runs real
``kvtier serve`` processes over a Mooncake fleet. (s31 r2 D3)"""

from __future__ import annotations

import json
import logging

import pytest

from kvtier.cli.admin import admin_call
from kvtier.errors import ConfigError
from kvtier.server.runtime_state import RuntimeState
from tests.server.harness import TOKENS
from tests.server.test_fleet_erase_and_stalls import _serve, cluster  # noqa: F401
from tests.tiers.mooncake_harness import mooncake_available

DISK_KEY, STATE_DIR_KEY = b"d" * 32, b"s" * 32


def _erased_with_a_quota(path, key: bytes) -> None:
    """A runtime state that erased acme's "chat" and set a quota, under ``key``."""
    state = RuntimeState(str(path), erasure_key=key)
    state.set_quota("acme", 1 << 30)
    state.record_erasure("acme", "chat", None, 1000.0)


@pytest.mark.parametrize("before, after", [(DISK_KEY, STATE_DIR_KEY), (STATE_DIR_KEY, DISK_KEY)],
                         ids=["disk dropped", "disk added"])
def test_tombstones_of_another_key_are_dropped_and_the_overrides_kept(tmp_path, caplog, before, after):
    path = tmp_path / "runtime.json"
    _erased_with_a_quota(path, before)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        state = RuntimeState(str(path), erasure_key=after)  # (a file with key ids: a disk or none alike)
    assert state.quota == {"acme": 1 << 30}
    assert state.erasures() == {} and not state.erased("acme", "chat", "", 999.0)
    assert "1 erasure records written under another key" in caplog.text
    state.record_erasure("globex", None, None, 2000.0)  # written under this key from now on
    assert RuntimeState(str(path), erasure_key=after).erasures() == {("globex", None, None): 2000.0}


def test_tombstones_of_this_key_that_were_edited_stop_the_start(tmp_path):
    path = tmp_path / "runtime.json"
    _erased_with_a_quota(path, DISK_KEY)
    doc = json.loads(path.read_text())
    doc["erasures"][0][3] = 1.0  # moved back before the blocks it erased
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="edited"):
        RuntimeState(str(path), erasure_key=DISK_KEY)


def test_tombstones_that_authenticate_under_this_key_are_kept_whatever_their_key_id_says(tmp_path):
    """The id is not under the MAC: one damaged digit of it made records that verify read as another
    key's, and dropped them with a warning (erased blocks could be indexed again). Control above: a
    file of another key whose records do not verify is dropped."""
    path = tmp_path / "runtime.json"
    _erased_with_a_quota(path, DISK_KEY)
    doc = json.loads(path.read_text())
    doc["erasures_key"] = ("0" if doc["erasures_key"][0] != "0" else "1") + doc["erasures_key"][1:]
    path.write_text(json.dumps(doc))
    state = RuntimeState(str(path), erasure_key=DISK_KEY)
    assert state.erasures() == {("acme", "chat", None): 1000.0} and state.erased("acme", "chat", "", 999.0)


def _written_before_key_ids(path, key: bytes) -> None:
    _erased_with_a_quota(path, key)
    doc = json.loads(path.read_text())
    del doc["erasures_key"]
    path.write_text(json.dumps(doc))


def test_tombstones_from_before_key_ids_of_a_dropped_disk_are_dropped_without_a_disk(tmp_path, caplog):
    path = tmp_path / "runtime.json"
    _written_before_key_ids(path, DISK_KEY)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        state = RuntimeState(str(path), erasure_key=STATE_DIR_KEY, unkeyed_erasures_must_authenticate=False)
    assert state.quota == {"acme": 1 << 30} and state.erasures() == {}
    assert "written before key ids were kept" in caplog.text


def test_tombstones_from_before_key_ids_are_read_where_they_authenticate(tmp_path):
    path = tmp_path / "runtime.json"
    _written_before_key_ids(path, STATE_DIR_KEY)
    for must in (True, False):
        state = RuntimeState(str(path), erasure_key=STATE_DIR_KEY, unkeyed_erasures_must_authenticate=must)
        assert state.erased("acme", "chat", "", 999.0)


def test_tombstones_from_before_key_ids_that_do_not_authenticate_stop_a_server_with_a_disk(tmp_path):
    path = tmp_path / "runtime.json"
    _written_before_key_ids(path, STATE_DIR_KEY)
    with pytest.raises(ConfigError, match="do not authenticate"):
        RuntimeState(str(path), erasure_key=DISK_KEY, unkeyed_erasures_must_authenticate=True)


@pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))
@pytest.mark.parametrize("first, then", [("disk", "fleet only"), ("fleet only", "disk")])
def test_a_server_starts_after_its_disk_was_dropped_or_added(tmp_path, cluster, first, then):  # noqa: F811
    """A server that erased something and set a quota restarts with a disk dropped or added, the same
    ``state_dir``: it starts, and the quota set through the admin API still holds."""
    def config(kind: str) -> dict:
        disk = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"} if kind == "disk" else {}
        return {"state_dir": str(tmp_path / "state"), "mooncake_timeout_s": 0.5, **disk}

    with _serve(tmp_path, cluster, **config(first)) as srv:
        assert admin_call(srv.tcp_url, TOKENS["admin"], "set_quota", {"tenant": "acme", "bytes": 1 << 30})["ok"]
        assert admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "chat"})["ok"]
    with _serve(tmp_path, cluster, **config(then)) as srv:
        usage = admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})
    assert usage["ok"] and usage["usage"]["acme"]["quota"] == 1 << 30, usage
