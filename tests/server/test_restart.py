"""A restarted ``kvtier serve`` loses nothing it had on disk: real server processes, SIGTERM, restart.

Blocks spilled to ``disk_dir`` (by eviction or by write-behind, and at the
latest by the SIGTERM flush) come back in the index: they hit with their bytes,
count toward quotas, expire by their original creation time, and ``admin erase``
deletes their files. A file whose annotation does not authenticate is never
served. Runtime quota and TTL changes survive the restart.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.core.payload import HEADER_NBYTES, unpack_header
from kvtier.server.auth import KeySpace
from kvtier.server.launch import ServerProcess
from kvtier.server.spill import SpillAnnotation, SpillCodec, secret_in
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk import BlockRecord, DiskTier, pack_record, unpack_record
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants

SLOT = 128 * 1024


class Restartable:
    """One server configuration on one work directory, started and stopped (SIGTERM) at will."""

    def __init__(self, workdir: Path, tenant_specs: dict | None = None, **server) -> None:
        self.workdir = workdir
        self.disk = workdir / "disk"
        self.tenants = tenant_specs or tenants()
        self.server = {"capacity": 64 * SLOT, "max_block": SLOT, "disk_dir": str(self.disk),
                       "disk_capacity": "64MiB", "sweep_interval_s": 0.1, **server}
        self.srv: ServerProcess | None = None
        self.env: dict | None = None

    def start(self) -> ServerProcess:
        self.srv = ServerProcess.start(self.tenants, shared=SHARED, admin_token=TOKENS["admin"],
                                       workdir=str(self.workdir), server=self.server, env=self.env)
        return self.srv

    def stop(self) -> tuple[int, str]:
        """SIGTERM; the exit status and the server's log."""
        rc = self.srv.stop(timeout_s=60)
        return rc, self.srv.log()

    def admin(self, cmd: str, **args) -> dict:
        return admin_call(self.srv.tcp_url, TOKENS["admin"], cmd, args)


def put(srv, who: str, ns: str, keys, **kw) -> None:
    tier = remote(srv, who, namespace=ns)
    try:
        assert tier.put_many(keys, [block(k, SLOT) for k in keys], **kw) == [Status.OK] * len(keys)
    finally:
        tier.close()


def get(srv, who: str, ns: str, keys) -> list[bool]:
    """Per key: read OK and its bytes are the ones written."""
    tier = remote(srv, who, namespace=ns)
    try:
        outs = [np.full(SLOT, 0xAB, np.uint8) for _ in keys]  # poisoned: a read that writes nothing fails
        statuses = tier.get_many(keys, outs)
        return [s is Status.OK and np.array_equal(o, block(k, SLOT)) for s, o, k in zip(statuses, outs, keys)]
    finally:
        tier.close()


def block_files(disk: Path) -> list[Path]:
    return sorted(p for p in disk.rglob("*.kvb"))


def owners_on_disk(disk: Path) -> Counter:
    """Owner named by each block file's (authenticated) annotation; "?" for an unattributed one."""
    codec = SpillCodec(secret_in(str(disk)))
    out: Counter = Counter()
    for path in block_files(disk):
        key = bytes.fromhex(path.stem)
        page = path.read_bytes()[:PAGE]
        header = unpack_header(page)
        record = unpack_record(page, key) if header is not None else None
        note = codec.unpack(key, record.annotation) if record is not None else None
        out[note.owner if note is not None else "?"] += 1
    return out


def stopped_cleanly(rc: int, log: str) -> dict:
    assert rc == 0, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    line = [ln for ln in log.splitlines() if "stopped; flushed" in ln][-1]
    words = line.replace(",", "").split()
    return {"flushed": int(words[words.index("flushed") + 1]), "dropped": int(words[words.index("dropped") + 1])}


# -- nothing lost -----------------------------------------------------------------------------
def test_sigterm_flushes_dram_only_blocks_and_a_restart_serves_them(tmp_path):
    """A pool large enough that nothing is ever evicted: before write-behind, every block lived
    only in DRAM and a SIGTERM lost all of them."""
    s = Restartable(tmp_path)
    srv = s.start()
    acme, globex = keys_for("sigterm-acme", 20), keys_for("sigterm-globex", 6)
    put(srv, "acme", "chat", acme, session="s1")
    put(srv, "globex", "chat", globex)
    assert s.admin("stats")["store"]["tiers"]["host"]["evictions"] == 0
    report = stopped_cleanly(*s.stop())
    assert report["dropped"] == 0
    assert owners_on_disk(s.disk) == Counter({"acme": 20, "globex": 6})

    srv = s.start()
    assert s.admin("stats")["recovered"]["recovered"] == 26
    assert remote(srv, "acme", namespace="chat").lookup_prefix(acme) == 20
    assert get(srv, "acme", "chat", acme) == [True] * 20
    assert get(srv, "globex", "chat", globex) == [True] * 6
    # isolation survives the restart: the same keys in another tenant or namespace are misses
    assert remote(srv, "globex", namespace="chat").lookup_prefix(acme) == 0
    assert remote(srv, "acme", namespace="other").lookup_prefix(acme) == 0
    assert s.admin("check")["consistent"]
    stopped_cleanly(*s.stop())


def test_spilled_blocks_survive_a_restart_with_their_chain(tmp_path):
    """A small pool: most blocks reach disk by eviction, the rest at shutdown."""
    s = Restartable(tmp_path, capacity=4 * SLOT)
    srv = s.start()
    keys = keys_for("spill-restart", 16)
    put(srv, "acme", "chat", keys)
    stopped_cleanly(*s.stop())
    srv = s.start()
    assert get(srv, "acme", "chat", keys) == [True] * 16
    usage = s.admin("usage")["usage"]["acme"]
    assert (usage["blocks"], usage["bytes"]) == (16, 16 * SLOT)
    stopped_cleanly(*s.stop())


def test_restart_then_erase_leaves_no_file_of_that_tenant(tmp_path):
    s = Restartable(tmp_path)
    srv = s.start()
    acme, globex = keys_for("erase-acme", 10), keys_for("erase-globex", 4)
    put(srv, "acme", "a", acme[:6])
    put(srv, "acme", "b", acme[6:], session="x")
    put(srv, "globex", "a", globex)
    stopped_cleanly(*s.stop())

    srv = s.start()
    assert get(srv, "acme", "a", acme[:6]) == [True] * 6  # a hit after the restart...
    erased = s.admin("erase", tenant="acme")
    assert erased["ok"] and erased["erased"] == 10  # ...and erasure finds every block: before, 0
    assert remote(srv, "acme", namespace="a").lookup_prefix(acme[:6]) == 0
    time.sleep(0.5)  # let any write-behind in flight land (it must not resurrect an erased block)
    on_disk = owners_on_disk(s.disk)
    assert on_disk["acme"] == 0 and on_disk["?"] == 0, on_disk
    assert on_disk["globex"] == 4  # the control: the other tenant's files stay, and still hit
    assert get(srv, "globex", "a", globex) == [True] * 4
    stopped_cleanly(*s.stop())
    srv = s.start()  # and nothing of acme comes back
    assert remote(srv, "acme", namespace="a").lookup_prefix(acme[:6]) == 0
    assert s.admin("usage")["usage"]["acme"]["blocks"] == 0
    stopped_cleanly(*s.stop())


def test_ttl_counts_from_the_original_creation_across_a_restart(tmp_path):
    ttl = 3.0
    s = Restartable(tmp_path, tenants(acme={"namespace_ttl_s": {"short": ttl}}))
    srv = s.start()
    short, keep = keys_for("ttl-short", 5), keys_for("ttl-keep", 5)
    t0 = time.monotonic()
    put(srv, "acme", "short", short)
    put(srv, "acme", "keep", keep)
    stopped_cleanly(*s.stop())
    time.sleep(max(0.0, t0 + ttl + 0.5 - time.monotonic()))  # the short blocks are now expired
    srv = s.start()
    # The sweeper, not a lookup, removes them: a restart that took the restart time as creation
    # time would keep them another `ttl` seconds. No lookup happens before these checks.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and s.admin("stats")["expirations"] < 5:
        time.sleep(0.1)
    assert s.admin("stats")["expirations"] == 5
    assert s.admin("usage")["usage"]["acme"]["blocks"] == 5
    assert owners_on_disk(s.disk)["acme"] == 5  # the expired files are gone
    assert get(srv, "acme", "keep", keep) == [True] * 5
    assert get(srv, "acme", "short", short) == [False] * 5
    stopped_cleanly(*s.stop())


def test_quota_usage_counts_recovered_blocks(tmp_path):
    s = Restartable(tmp_path, tenants(acme={"quota": 8 * SLOT}))
    srv = s.start()
    old = keys_for("quota-old", 8)
    put(srv, "acme", "q", old)
    stopped_cleanly(*s.stop())
    srv = s.start()
    assert s.admin("usage")["usage"]["acme"]["bytes"] == 8 * SLOT
    new = keys_for("quota-new", 4)
    put(srv, "acme", "q", new)  # over quota: acme's own least recent (recovered) blocks go
    usage = s.admin("usage")["usage"]["acme"]
    assert usage["bytes"] == 8 * SLOT
    tier = remote(srv, "acme", namespace="q")
    assert tier.contains_many(new) == [True] * 4
    assert sum(tier.contains_many(old)) == 4
    stopped_cleanly(*s.stop())


# -- never a wrong block ----------------------------------------------------------------------
def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _plant(disk: Path, codec: SpillCodec, owner: str, namespace: str, key: bytes, content: np.ndarray) -> None:
    """Write a block file as someone with write access to disk_dir would: right name, right format,
    an annotation claiming ``owner`` -- tagged with ``codec``'s secret."""
    from kvtier.core.payload import FLAG_CHECKSUM, checksum, pack_header

    skey = KeySpace.of(owner, namespace).storage_key(key)
    header = pack_header(key, content.nbytes, checksum(content), flags=FLAG_CHECKSUM)
    note = SpillAnnotation(owner, namespace, key, "", time.time(), header, content.nbytes, None)
    with DiskTier(disk, 64 << 20) as t:
        t.annotator = lambda name: BlockRecord(None, codec.pack(name, note))
        assert t.put(skey, content) is Status.OK


def _rewrite_annotation(path: Path, change) -> None:
    """Change a block file's annotation and fix up the disk record's (unkeyed) checksum, as an
    attacker with write access to disk_dir can: only the server's tag can catch this."""
    key = bytes.fromhex(path.stem)
    page = path.read_bytes()[:PAGE]
    record = unpack_record(page, key)
    packed = pack_record(key, BlockRecord(record.parent, change(record.annotation)))
    with open(path, "r+b") as f:
        f.seek(HEADER_NBYTES)
        f.write(packed)


def test_tampered_or_planted_annotations_are_never_served(tmp_path):
    s = Restartable(tmp_path)
    srv = s.start()
    keys = keys_for("tamper", 5)
    put(srv, "acme", "t", keys)
    stopped_cleanly(*s.stop())
    files = {bytes.fromhex(p.stem): p for p in block_files(s.disk)}
    assert len(files) == 5
    acme = KeySpace.of("acme", "t")
    flipped, rewritten = files[acme.storage_key(keys[1])], files[acme.storage_key(keys[3])]
    _flip(flipped, HEADER_NBYTES + 48 + 5)  # a bit of the annotation: the disk record's check
    _rewrite_annotation(rewritten, lambda a: a.replace(b"acme", b"acmf"))  # consistent, but untagged
    assert unpack_record(rewritten.read_bytes()[:PAGE], bytes.fromhex(rewritten.stem)) is not None
    # A planted block claiming to be globex's, under the right name, with a forged tag; and a
    # control planted the same way with the real secret (which only the server's user can read):
    # that one is served, so the forged one is refused for its tag and nothing else.
    forged_key, real_key = keys_for("planted", 2)
    _plant(s.disk, SpillCodec(os.urandom(32)), "globex", "t", forged_key, np.full(SLOT, 7, np.uint8))
    _plant(s.disk, SpillCodec(secret_in(str(s.disk))), "globex", "t", real_key, block(real_key, SLOT))

    srv = s.start()
    recovered = s.admin("stats")["recovered"]
    assert (recovered["recovered"], recovered["rejected"]) == (3 + 1, 2), recovered
    assert s.admin("stats")["store"]["tiers"]["disk"]["verify_failures"] == 1  # the flipped bit
    assert remote(srv, "acme", namespace="t").contains_many(keys) == [True, False, True, False, True]
    assert get(srv, "acme", "t", keys) == [True, False, True, False, True]
    glob = remote(srv, "globex", namespace="t")
    assert glob.get(forged_key, np.zeros(SLOT, np.uint8)) is Status.MISS
    assert get(srv, "globex", "t", [real_key]) == [True]
    assert not flipped.exists() and not rewritten.exists()
    assert len(block_files(s.disk)) == 3 + 1
    stopped_cleanly(*s.stop())


def test_the_spill_secret_is_private_and_refused_otherwise(tmp_path):
    s = Restartable(tmp_path)
    s.start()
    stopped_cleanly(*s.stop())
    secret = s.disk / "server.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    secret.chmod(0o644)
    with pytest.raises(RuntimeError, match="mode 0600"):
        s.start()


def test_encrypted_spill_survives_a_restart(tmp_path):
    s = Restartable(tmp_path, encrypt_at_rest=True)
    s.env = {"KVTIER_MASTER_KEY": "5a" * 32}
    srv = s.start()
    keys = keys_for("sealed-restart", 6)
    put(srv, "acme", "enc", keys)
    stopped_cleanly(*s.stop())
    on_disk = b"".join(p.read_bytes() for p in block_files(s.disk))
    assert len(block_files(s.disk)) == 6
    assert block(keys[0], SLOT).tobytes()[:512] not in on_disk
    assert not (s.disk / "server.secret").exists()  # the secret derives from the master key
    srv = s.start()
    assert get(srv, "acme", "enc", keys) == [True] * 6
    erased = s.admin("erase", tenant="acme")
    assert erased["erased"] == 6 and erased["keys_shredded"]
    assert block_files(s.disk) == []
    stopped_cleanly(*s.stop())


# -- runtime admin changes --------------------------------------------------------------------
def test_runtime_quota_and_ttl_changes_survive_a_restart_and_win_over_the_config(tmp_path):
    s = Restartable(tmp_path, tenants(acme={"quota": 8 * SLOT}, globex={"ttl_s": 600}))
    s.start()
    assert s.admin("set_quota", tenant="acme", bytes=3 * SLOT)["ok"]
    assert s.admin("set_quota", tenant="globex", bytes=5 * SLOT)["ok"]
    assert s.admin("set_ttl", tenant="acme", ttl_s=42, namespace="scratch")["ok"]
    assert s.admin("set_ttl", tenant="globex", ttl_s=0)["ok"]  # removes the config's TTL
    stopped_cleanly(*s.stop())
    state = s.disk / "runtime.json"
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert json.loads(state.read_text())["quota"] == {"acme": 3 * SLOT, "globex": 5 * SLOT}
    s.start()
    policy = s.admin("usage")["policy"]
    assert policy["quota_bytes"] == {"acme": 3 * SLOT, "globex": 5 * SLOT}  # config said 8 slots
    assert policy["namespace_ttl_s"] == {"acme:scratch": 42}
    assert policy["tenant_ttl_s"] == {}  # the config's 600 s stays removed
    # and the restored quota is enforced
    put(s.srv, "acme", "q", keys_for("runtime-quota", 5))
    assert s.admin("usage")["usage"]["acme"]["bytes"] == 3 * SLOT
    stopped_cleanly(*s.stop())


def test_a_namespace_kept_from_its_tenants_ttl_stays_kept_after_a_restart(tmp_path):
    """A namespace TTL of 0 (no expiry, even under the tenant's TTL) is saved as 0, a removed one
    as null; after a restart keep's blocks (rebuilt from disk, with their age) still do not expire,
    while a namespace whose own TTL was removed follows the tenant's again."""
    s = Restartable(tmp_path, tenants(acme={"ttl_s": 2.0, "namespace_ttl_s": {"cfg": 600}}))
    s.start()
    assert s.admin("set_ttl", tenant="acme", ttl_s=0, namespace="keep")["ok"]
    assert s.admin("set_ttl", tenant="acme", ttl_s=None, namespace="cfg")["ok"]  # the config's 600 s removed
    t0 = time.monotonic()
    keep, cfg = keys_for("keep-restart", 3), keys_for("cfg-restart", 3)
    put(s.srv, "acme", "keep", keep)
    put(s.srv, "acme", "cfg", cfg)
    stopped_cleanly(*s.stop())
    saved = json.loads((s.disk / "runtime.json").read_text())["namespace_ttl_s"]
    assert saved == [["acme", "cfg", None], ["acme", "keep", 0]], saved
    s.start()
    assert s.admin("usage")["policy"]["namespace_ttl_s"] == {"acme:keep": 0}
    time.sleep(max(0.0, t0 + 2.0 + 0.5 - time.monotonic()))  # past the tenant's TTL
    assert get(s.srv, "acme", "keep", keep) == [True] * 3, "no expiry (0) did not outlast the restart"
    assert get(s.srv, "acme", "cfg", cfg) == [False] * 3, "a removed namespace TTL: the tenant's 2 s apply"
    stopped_cleanly(*s.stop())


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-1"])
def test_a_persisted_non_finite_ttl_is_refused_at_start_naming_the_file(tmp_path, bad):
    """json reads NaN / Infinity; a NaN TTL would make the sweeper delete every block of the
    owner, so a runtime.json holding one stops the start (naming the file) instead."""
    from kvtier.errors import ConfigError
    from kvtier.server.runtime_state import RuntimeState

    for doc in (f'{{"version": 1, "tenant_ttl_s": {{"acme": {bad}}}}}',
                f'{{"version": 1, "namespace_ttl_s": [["acme", "scratch", {bad}]]}}'):
        path = tmp_path / "runtime.json"
        path.write_text(doc)
        with pytest.raises(ConfigError, match="runtime.json"):
            RuntimeState(str(path))
    path.write_text('{"version": 1, "tenant_ttl_s": {"acme": 3.5}, "namespace_ttl_s": [["acme", "scratch", 9]]}')
    state = RuntimeState(str(path))                                     # control: finite values load
    assert (state.tenant_ttl_s, state.namespace_ttl_s) == ({"acme": 3.5}, {("acme", "scratch"): 9.0})
