"""``Server``: the shared pod tier -- listeners, the store behind them, timers, and shutdown.

One asyncio event loop (uvloop when installed) runs every connection, the
metrics endpoint and two timers: a watchdog that closes idle or stalled
connections, and a sweeper that deletes expired blocks. Disk I/O (lower-tier
reads, demotions during a put) runs on a small thread pool.

Storage is a :class:`~kvtier.store.tiered.TieredStore` of a
:class:`~kvtier.tiers.host.HostTier` pool and, if ``disk_dir`` is
set, a :class:`~kvtier.tiers.disk.DiskTier`. With a disk tier:

* every committed block is scheduled for write-behind to disk (and host
  evictions demote what is not there yet), each file carrying the block's index
  entry, authenticated (:mod:`kvtier.server.spill`, :mod:`kvtier.server.recovery`);
* at start the index is rebuilt from those files: spilled blocks hit, count
  toward quotas, expire and are erased as before the restart;
* SIGTERM / SIGINT stop accepting, close connections, then flush the blocks
  not yet on disk for at most ``shutdown_flush_timeout_s`` and report
  ("flushed N, dropped M": M blocks that only DRAM held are lost) before
  exiting 0. The write-behind backlog holds a mark for every block the pool
  can hold, so no acknowledged block loses its mark before the shutdown, and
  the shutdown marks again any block the pool holds that no lower tier does
  (a copy that failed).

With a Mooncake fleet below (``mooncake_master``), what DRAM or disk evicts
spills there. The fleet's names are one-way and cannot be listed, so the server
journals what it places there in ``state_dir`` (default ``disk_dir``;
:mod:`kvtier.server.fleet`), before each put, and indexes it again at start,
after a SIGTERM or a crash: restarted, it serves, erases and expires those
blocks as before. Without any state directory nothing is journaled: the
shutdown deletes from the fleet every block the server indexes (a restart could
not reach them; "deleted N from the Mooncake fleet"), and after a crash they
are left to the fleet's own eviction -- give such a server a ``state_dir``.

Runtime admin changes (quotas, TTLs) persist in ``state_dir`` (default
``disk_dir``; :mod:`kvtier.server.runtime_state`) and win over the config file.
What a restart reads back from ``state_dir`` (the fleet journal's records, the
erasures' tombstones) is authenticated under one state key whatever the tiers
(:meth:`Server._state_codecs`); the disk spill's annotations under the disk's.
Without encryption at rest that key is ``state_dir/server.secret``, which moves
with the state: a start that would make it anew over records no key it holds
reads is refused (:func:`_refuse_a_new_secret_over_records`); with a fleet and the state kept in
``disk_dir`` (no ``state_dir``), ``disk_dir/server.secret`` is that key, held to the same rule.
A ``state_dir`` set while ``disk_dir`` still holds the state kept there without one is refused,
naming the files to move (:func:`_refuse_state_left_in_disk_dir`). Blocks indexed again at start
are charged their pool footprint, as at their PUT (:meth:`Server._charge_recovered`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import signal
import socket
import ssl
import stat
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from kvtier.errors import ConfigError
from kvtier.open_file_limit import raise_open_file_limit
from kvtier.private_files import make_private_dirs, open_private_file
from kvtier.server.admission import Admission, LoginLimiter
from kvtier.server.audit import AuditLog
from kvtier.server.auth import Authenticator
from kvtier.server.config import ServerConfig, cleartext_beyond_host, events_subscriber_scopes, parse_listen
from kvtier.server.connection import Connection
from kvtier.server.governance import Governance
from kvtier.server.index import BlockEntry, BlockIndex
from kvtier.server.metrics import MetricsAuth, ServerMetrics, serve_http, tier_and_tenant_families
from kvtier.server.runtime_state import FILE_NAME as RUNTIME_STATE_FILE
from kvtier.server.runtime_state import RuntimeState
from kvtier.server.service import Service
from kvtier.server.spill import SECRET_FILE, STATE_SECRET, SpillCodec, secret_in, would_make_a_secret
from kvtier.tiers.remote_protocol import ErrorCode
from kvtier.tiers.host import HostTier
from kvtier.store import safety
from kvtier.store.tiered import TieredStore
from kvtier.unix_sockets import socket_is_live

log = logging.getLogger(__name__)

#: how long a stop waits for the connections' cancelled tasks to end
TASKS_END_S = 10.0


class StateCodecs(NamedTuple):
    """The codecs of the records kept in ``state_dir`` (:meth:`Server._state_codecs`)."""

    current: SpillCodec  #: writes them, and reads them
    older: tuple[SpillCodec, ...]  #: other keys of this server that earlier versions wrote them under: read


def _host_port(sockname: tuple) -> str:
    """``HOST:PORT`` of a bound socket, an IPv6 host in brackets: the ready line's addresses are
    what clients are handed, and ``::1:7070`` parses as no address at all."""
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _remove_stale_socket(path: str) -> None:
    """Remove the socket a previous run left at ``path``; raise ``OSError(EADDRINUSE)`` if a live
    server answers there. A socket file says nothing of whether anyone listens on it: removing it
    unasked let a second server (a restart begun early, a duplicate launch) take over a running
    server's path, and the first one's stop then removed the second's socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        return   # not a socket: binding fails with its own error, nothing of ours is removed
    if not socket_is_live(path):
        try:
            os.unlink(path)   # nobody listens: a stale socket of a previous run
        except FileNotFoundError:
            pass
        return
    raise OSError(errno.EADDRINUSE, f"another server listens on unix://{path}")


def _unix_socket_0660(path: str) -> socket.socket:
    """A Unix stream socket bound at ``path``, mode 0660, not listening yet (the event loop's server
    listens on it). Set before the listen: bound with the umask's mode (0777 under umask 0) and
    listening, it accepted any local user until a chmod, and a connection made then stayed, exempt
    from the failed-login throttle as a Unix peer. A socket that does not listen refuses connections."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o660)
    except BaseException:
        sock.close()
        raise
    return sock


def _refuse_state_left_in_disk_dir(config: ServerConfig) -> None:
    """Raise ConfigError where ``state_dir`` is set apart from ``disk_dir`` while ``disk_dir`` still
    holds the state a server keeps there by default (runtime.json, fleet.journal): started, this
    server would never read it -- the erasures' tombstones lost (an erased tenant's old files put
    back would be served again, under the disk's unchanged secret), the quota and TTL overrides
    gone, the blocks the journal placed in the fleet beyond erase and TTL."""
    if not (config.state_dir and config.disk_dir) or _same_directory(config.state_dir, config.disk_dir):
        return
    from kvtier.server.fleet_journal import JOURNAL_FILE

    left = [name for name in (RUNTIME_STATE_FILE, JOURNAL_FILE)
            if os.path.lexists(os.path.join(config.disk_dir, name))]
    if not left:
        return
    _refuse_state_in_both(config, left)
    files = " ".join(os.path.join(config.disk_dir, name) for name in left)
    # (mv -n: should state_dir get such a file meanwhile, it is kept, not replaced)
    raise ConfigError(
        f"state_dir {config.state_dir!r} is set, but disk_dir {config.disk_dir!r} still holds the state kept there "
        f"without one ({' and '.join(left)}: {_WHAT_STATE_HOLDS}), which this server would never read. Move them "
        f"into state_dir: (umask 077; mkdir -p {config.state_dir}) && mv -n {files} {config.state_dir}/ -- leave "
        f"disk_dir's {SECRET_FILE} where it is (it keys the spilled blocks, and the records moved are still read "
        f"under it); or leave state_dir out of the config")


#: what runtime.json and fleet.journal hold, as the refusals about them say it
_WHAT_STATE_HOLDS = ("the erasures' tombstones, the quota and TTL overrides, the records of blocks placed in the "
                     "Mooncake fleet")


def _refuse_state_in_both(config: ServerConfig, left: list[str]) -> None:
    """Raise ConfigError where ``state_dir`` already holds a file of a name in ``left`` (the state files
    ``disk_dir`` holds too): a run without state_dir wrote disk_dir's while state_dir kept its own
    (a config rolled back, then restored). Moving one over the other would lose what the replaced
    file holds (its erasures' tombstones: erased blocks served again; its fleet records: blocks
    beyond erase and TTL); nothing is merged, the operator chooses."""
    both = [name for name in left if os.path.lexists(os.path.join(config.state_dir, name))]
    if not both:
        return
    pairs = "; ".join(f"{os.path.join(config.disk_dir, name)} and {os.path.join(config.state_dir, name)}"
                      for name in both)
    raise ConfigError(
        f"both disk_dir {config.disk_dir!r} and state_dir {config.state_dir!r} hold the server's state ({pairs}: "
        f"{_WHAT_STATE_HOLDS}); a run without state_dir wrote disk_dir's. Nothing is merged, and moving one over "
        f"the other loses what it holds (an erasure's tombstone lost: the erased blocks are served again). Keep "
        f"the one to go on with in state_dir, and move disk_dir's aside, out of disk_dir (an erasure recorded only "
        f"there is then not applied: erase that tenant again after the start); or leave state_dir out of the config")


def _same_directory(a: str, b: str) -> bool:
    """Whether two paths name one directory (a link or a trailing slash apart)."""
    return os.path.realpath(a) == os.path.realpath(b)


def _refuse_a_new_secret_over_records(state_dir: str, held: tuple[SpillCodec, ...], *,
                                      where: str = "state_dir") -> None:
    """Raise ConfigError where ``state_dir`` has no secret (one would be made) but holds records no
    key of this server's (``held``: the disk spill's) authenticates: erasure tombstones or a fleet
    journal's records keyed by a secret that did not move with them (``state_dir`` moved without
    it, or it was removed). A new secret would set the tombstones aside -- an erased tenant's old
    files put back would be served again -- and delete every block the journal names from the
    fleet. Records the disk's secret authenticates are an earlier version's (it keyed them so
    wherever there was a disk): the upgrade makes the secret and writes them anew under it.
    ``where`` names the directory in the error: "state_dir", or the disk_dir that keeps the state."""
    if not would_make_a_secret(state_dir):
        return
    from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
    from kvtier.server.runtime_state import erasures_of_another_key

    found = []
    tombstones = erasures_of_another_key(os.path.join(state_dir, RUNTIME_STATE_FILE), [c.erasure_key() for c in held])
    if tombstones:
        found.append(f"{tombstones} erasure tombstones in {RUNTIME_STATE_FILE}")
    records = FleetJournal.records_in(os.path.join(state_dir, JOURNAL_FILE))
    if records and not any(codec.unpack(name, record) is not None for name, record in records for codec in held):
        found.append(f"{len(records)} records of blocks placed in the Mooncake fleet in {JOURNAL_FILE}")
    if not found:
        return
    secret = os.path.join(state_dir, SECRET_FILE)
    upgrade = ("" if where != "state_dir" else
               " (Where an earlier version keyed them by the disk spill's secret -- the first start since the "
               "upgrade, with disk_dir dropped from the config -- start once with that disk_dir configured.)")
    raise ConfigError(
        f"{where} {state_dir!r} holds {' and '.join(found)}, keyed by a {SECRET_FILE} that is not there: the secret "
        f"moves with the state. Put it back ({secret}, mode 0600: from where the state was, or a backup).{upgrade} "
        f"A new secret would set the tombstones aside (an erased tenant's old files put back would be served again) "
        f"and delete every block the journal names from the fleet; to accept that, make one yourself: "
        f"(umask 077; head -c 32 /dev/urandom > {secret})")


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # first: a key file to fix stops the start before anything is allocated
        self._tls = self._tls_context() if any(parse_listen(u)[0] == "tls" for u in config.listen) else None
        _refuse_state_left_in_disk_dir(config)  # (before the disk tier or a secret is made)
        self.host = HostTier(config.capacity_bytes, config.max_block_bytes, slabs=False)  # quotas charge exactly
        self.index = BlockIndex()
        self.keyring = None
        self._master_key: bytes | None = None
        tiers = [self.host]
        disk = None
        if config.disk_dir:
            from kvtier.tiers.disk import DiskTier

            # a file per spilled block (not packed batches): what its erasure and audits expect
            disk = DiskTier(config.disk_dir, config.disk_capacity_bytes, pack_batches=False)
            if not config.encrypt_at_rest:
                safety.warn_server_plaintext(config.disk_dir)
            tiers.append(self._sealed(disk) if config.encrypt_at_rest else disk)
        state_dir = config.state_dir or config.disk_dir
        disk_codec = self._spill_codec(state_dir) if disk is not None else None
        codecs = self._state_codecs(disk_codec, state_dir)
        # Erasure records (tombstones) are authenticated under the state key: kept wherever a disk
        # spill or a fleet journal could bring an erased block back at the next start. (Those of a
        # key this server does not hold are kept aside in the file: kvtier/server/runtime_state.py.)
        state = RuntimeState(os.path.join(state_dir, RUNTIME_STATE_FILE) if state_dir else None,
                             erasure_key=codecs.current.erasure_key() if codecs is not None else None,
                             older_erasure_keys=[c.erasure_key() for c in codecs.older] if codecs is not None else (),
                             unkeyed_erasures_must_authenticate=disk is not None)
        #: the fleet tier with its journal (kvtier/server/fleet.py); None: no fleet, or no state_dir to keep it in
        self.fleet = None
        if config.mooncake_master:  # the fleet below: blocks evicted above spill there (kvtier/tiers/mooncake.py)
            tiers.append(self._fleet_tier(state_dir, codecs, state))
        # A write-behind mark for every block the pool can hold (blocks of the smallest footprint):
        # a mark dropped from a full backlog would leave its block out of the shutdown flush. Marks
        # exist only for blocks in DRAM not yet copied down (~160 B each while they wait).
        most_blocks = self.host.capacity_bytes // self.host.footprint(1)
        self.store = TieredStore(tiers, dirty_limit_blocks=max(16384, most_blocks))
        self.governance = Governance(config, state)
        if state.path is not None:  # LIST cursors of an earlier run never skip a block (kvtier/server/index.py)
            self.index.number_after(state.list_high_water, state.set_list_high_water)
        self.spill = self._spill_binding(disk, disk_codec, state) if disk is not None else None
        #: what the start found on disk (see :meth:`_recover`)
        self.recovered: dict = {}
        #: what the shutdown flush did: {"flushed", "dropped", "seconds"}
        self.shutdown_report: dict | None = None
        self.metrics = ServerMetrics()
        self.audit = AuditLog(config.audit_log)
        self.events = None
        if config.events:
            from kvtier.server.events import EventPublisher

            self.events = EventPublisher(
                config.events, name_key=bytes.fromhex(config.events_name_key),
                curve_secret=config.events_curve_secret, subscribers=events_subscriber_scopes(config),
                buffer=config.events_buffer)
        self.service = Service(
            config=config, store=self.store, host=self.host, index=self.index, governance=self.governance,
            auth=Authenticator(config), metrics=self.metrics, audit=self.audit, events=self.events,
            keyring=self.keyring, spill=self.spill,
        )
        if self.spill is not None or self.fleet is not None:
            self._recover(state)
        self.metrics.add_collector(lambda: tier_and_tenant_families(
            self.store, self.index, self.governance, lambda: self.events.emitted if self.events else 0))
        self.connections: set[Connection] = set()
        self.admission = Admission(
            max_connections=config.max_connections, max_unauthenticated=config.max_unauthenticated,
            max_per_peer=config.max_connections_per_peer,
            max_per_tenant=config.tenant_connection_cap,
            hello_timeout_s=config.hello_timeout_s)
        self.logins = LoginLimiter(burst=config.login_failure_burst, per_s=config.login_failure_rate_per_s)
        self._listeners: list[asyncio.AbstractServer] = []
        self._unix_paths: list[tuple[str, int, int]] = []  # (path, st_dev, st_ino) of each socket bound
        self._timers: list[asyncio.Task] = []
        self._stopping: asyncio.Event | None = None
        self.addresses: dict = {}

    def _sealed(self, disk):
        """Server-side encryption at rest, for engines that cannot hold keys: each
        spilled block is sealed under its owner's keys (the index knows the owner)."""
        from kvtier.crypto.keyring import Keyring
        from kvtier.crypto.providers import EnvMasterKey, FileMasterKey
        from kvtier.tiers.encrypted import EncryptedTier

        provider = FileMasterKey(self.config.master_key_file) if self.config.master_key_file else EnvMasterKey()
        self._master_key = provider.master_key()
        keystore = self.config.keystore_dir or os.path.join(self.config.disk_dir, "keys")
        # Blocks on disk need the key store they were sealed with: a missing or empty one (a
        # volume not mounted, a typo) is refused, not replaced by new keys that orphan them all.
        held = sum(1 for _ in disk.keys())  # what the disk tier found at its start
        self.keyring = Keyring(provider, keystore, required_by=(
            f"{self.config.disk_dir} holds {held} spilled block files sealed with it" if held else None))

        def owner_of(skey: bytes) -> str | None:
            # also a block removed from the index whose deletion is running: the service holds
            # its owner there until the tiers' delete ends (BlockIndex.deleting)
            return self.index.owner_of(skey)

        sealed = EncryptedTier(disk, self.keyring, tenant_of=owner_of)
        sealed.name = disk.name  # metrics and KV events name the medium
        return sealed

    def _fleet_tier(self, state_dir: str | None, codecs, state: RuntimeState):
        """The Mooncake fleet, with a journal of what is placed there in ``state_dir`` (its records
        authenticated by ``codecs``, :meth:`_state_codecs`) and the erasures' tombstones (``state``),
        so that erase and TTL reach those blocks after a restart, and an erased one is never indexed
        again. Without a state directory a clean shutdown deletes them from the fleet instead
        (:meth:`_shutdown_flush`)."""
        from kvtier.store.config import mooncake_tier_for_server

        journal = None
        if state_dir:
            from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal

            journal = FleetJournal(os.path.join(state_dir, JOURNAL_FILE))
        fleet = mooncake_tier_for_server(self.config, self.keyring)
        if journal is not None:
            from kvtier.server.fleet import FleetRecords, JournaledFleet

            # (under the sealing tier: it records the names blocks are stored under, as the disk does)
            records = FleetRecords(self.index, codecs.current, self.keyring, older_codecs=codecs.older,
                                   stamps=state.stamps)
            fleet = self.fleet = JournaledFleet(fleet, journal, records, tombstones=state)
        if self.keyring is None:
            return fleet  # names keyed, reads verified; plaintext in the fleet's memory
        from kvtier.tiers.encrypted import EncryptedTier

        sealed = EncryptedTier(fleet, self.keyring, tenant_of=self.index.owner_of)  # sealed per owner, as on disk
        sealed.name = fleet.name
        return sealed

    def _state_codecs(self, disk_codec: SpillCodec | None, state_dir: str | None) -> StateCodecs | None:
        """What authenticates the records a restart reads back from ``state_dir`` (fleet records,
        erasure tombstones): one key whatever the tiers -- the master key's codec with encryption at
        rest, else a secret of its own in ``state_dir`` (0600, refused if others may read it; never
        made over records it would have keyed: :func:`_refuse_a_new_secret_over_records`) -- so
        that a disk added to or dropped from the config leaves them this server's. (Versions before
        keyed them by the disk spill's secret where there was a disk: still read, ``older``.) None
        where nothing is read back: no disk, and no fleet journal."""
        if disk_codec is None and not (self.config.mooncake_master and state_dir):
            return None
        if self._master_key is not None:  # (the disk spill's codec too)
            return StateCodecs(disk_codec, ())
        held = (disk_codec,) if disk_codec is not None else ()
        try:
            make_private_dirs(state_dir)  # (before the fleet journal would: its secret is made first)
            _refuse_a_new_secret_over_records(state_dir, held)
            current = SpillCodec(secret_in(state_dir, STATE_SECRET))
        except OSError as exc:
            raise ConfigError(f"state_dir {state_dir!r}: {exc}; give the server a state_dir it can write: it keeps "
                              f"the erasures and the fleet journal, which let erase and TTL reach the blocks "
                              f"after a restart") from None
        # (the disk's codec stays an older key for as long as there is a disk: records it keyed are read)
        if disk_codec is None or disk_codec.erasure_key() == current.erasure_key():  # (state_dir is disk_dir)
            return StateCodecs(current, ())
        return StateCodecs(current, (disk_codec,))

    def _spill_codec(self, state_dir: str):
        # With encryption at rest the codec's keys derive from the master key, which lives outside
        # disk_dir, and it seals what it writes; otherwise an HMAC under a 0600 file in disk_dir
        # (see kvtier/server/spill.py for why).
        if self._master_key is not None:
            return SpillCodec.for_master_key(self._master_key)
        disk_dir = self.config.disk_dir
        if not (self.config.mooncake_master and _same_directory(state_dir, disk_dir)):
            return SpillCodec(secret_in(disk_dir))  # a new one drops the spilled blocks only, as its errors say
        # The state kept in disk_dir with a fleet: this secret keys the fleet journal and the erasures'
        # tombstones too, so it is the state's (its errors never advise removing it), and it is not made
        # anew over them: that would delete every block the journal placed in the fleet.
        _refuse_a_new_secret_over_records(disk_dir, (), where="disk_dir (which keeps the state: no state_dir)")
        return SpillCodec(secret_in(disk_dir, STATE_SECRET))

    def _spill_binding(self, disk, codec, state):
        from kvtier.server.recovery import SpillBinding

        binding = SpillBinding(self.index, disk, codec, self.keyring, erasures=state)
        disk.annotator = binding.record
        return binding

    def _recover(self, state: RuntimeState) -> None:
        """Index again what a previous run spilled to disk or placed in the fleet (before any
        connection is accepted), in one age order; what an erasure's tombstone in ``state`` covers
        is deleted instead."""
        from kvtier.server.config import SHARED_PREFIX
        from kvtier.server.recovery import Rebuilt, index_oldest_first

        t0 = time.monotonic()
        owners = {t.name for t in self.config.tenants} | {SHARED_PREFIX + s.name for s in self.config.shared}
        # (a shared block's payer is charged again only while it is still a writer of that namespace)
        writers = {SHARED_PREFIX + s.name: frozenset(s.writers) for s in self.config.shared}
        fleet = None
        if self.fleet is not None:
            from kvtier.server.fleet import rebuild_from_journal

            fleet = rebuild_from_journal(self.fleet, owners, state, writers=writers)
        if self.spill is not None:
            rebuilt = self.spill.rebuild(owners, also=fleet.found if fleet else (), writers=writers)
        else:
            rebuilt = Rebuilt(entries=index_oldest_first(self.index, fleet.found))
        for skey, entry in rebuilt.entries:
            self._charge_recovered(skey, entry)
            self.service.announce_stored(skey, entry.tier, entry)
        self.recovered = rebuilt.summary(self.spill.disk.name if self.spill is not None else "")
        if fleet is not None:  # (recovered: those indexed at the fleet; a block the disk holds too is the disk's)
            self.recovered["fleet"] = {**fleet.summary(), "recovered": rebuilt.summary(self.fleet.name)["recovered"]}
        self.recovered["seconds"] = round(time.monotonic() - t0, 3)
        if self.spill is not None:
            self.spill.last_rebuild = self.recovered  # admin stats show it

    def _charge_recovered(self, skey: bytes, entry: BlockEntry) -> None:
        """Charge a block indexed again at start its pool footprint, as its PUT was charged: a quota
        counts the same blocks at the same bytes before and after a restart (charged their payload
        only, a tenant at its quota of 64 B blocks could put as many again). A shared block is charged
        to its writer too, as at its PUT (its payer, kept in its annotation or fleet record), unless
        the config no longer names that tenant a writer of the namespace. The charge lasts while
        the block is indexed, whichever tier holds it, so its promotion into DRAM adds none."""
        self.governance.charge(skey, entry.accounts, entry.nbytes, self.host.footprint(entry.nbytes))

    # -- connections ----------------------------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        """A new socket, before TLS and HELLO (see :mod:`kvtier.server.admission`)."""
        decision = self.admission.connect(conn, None if conn.peer_host == "unix" else conn.peer_host)
        if not decision.ok:
            self.metrics.refused_connections.labels("pre_login").inc()
            return False
        if decision.evict is not None:  # the oldest silent socket makes room
            self.metrics.refused_connections.labels("pre_login_dropped").inc()
            decision.evict.fail(ErrorCode.TOO_MANY_CONNECTIONS, "no HELLO yet and the server needs the slot")
        self.connections.add(conn)
        self.metrics.connections.set(len(self.connections))
        return True

    def logged_in(self, conn: Connection, tenant: str) -> str | None:
        """HELLO succeeded; returns why the connection may not stay, or None."""
        decision = self.admission.login(conn, tenant)
        if not decision.ok:
            self.metrics.refused_connections.labels("post_login").inc()
            return decision.reason
        return None

    def forget(self, conn: Connection) -> None:
        self.admission.forget(conn)
        self.connections.discard(conn)
        self.metrics.connections.set(len(self.connections))

    def healthy(self) -> bool:
        return bool(self._listeners) and all(s.is_serving() for s in self._listeners)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> dict:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        urls = []
        for url in self.config.listen:
            scheme, host, port = parse_listen(url)
            factory = lambda: Connection(self)  # noqa: E731
            if scheme == "unix":
                _remove_stale_socket(host)
                srv = await loop.create_unix_server(factory, sock=_unix_socket_0660(host), backlog=1024)
                bound = os.stat(host)
                self._unix_paths.append((host, bound.st_dev, bound.st_ino))
                urls.append(f"unix://{host}")
            else:
                # TLS is started by the connection once admitted, so that handshakes in
                # progress hold pre-login slots and run under the HELLO deadline.
                factory = (lambda: Connection(self, tls=self._tls)) if scheme == "tls" else factory  # noqa: E731
                srv = await loop.create_server(factory, host, port, backlog=1024, reuse_address=True)
                bound = srv.sockets[0].getsockname()
                urls.append(f"{scheme}://{_host_port(bound)}")
            self._listeners.append(srv)
        self.addresses = {"listen": urls, "pid": os.getpid()}
        if self.config.metrics:
            c = self.config
            _, host, port = parse_listen("tcp://" + c.metrics)
            if c.admin_token_sha256 and not c.metrics_takes_admin_token and not c.metrics_token_sha256:
                log.warning("metrics %s is plain HTTP beyond loopback: the admin token is not taken there (it would "
                            "cross the network in cleartext), so its per-tenant series are shown to no one; add "
                            "metrics_token_sha256 (a read-only scrape token) or keep metrics on 127.0.0.1", c.metrics)
            auth = MetricsAuth(self.metrics, metrics_token_sha256=c.metrics_token_sha256,
                               admin_token_sha256=c.admin_token_sha256, admin_accepted=c.metrics_takes_admin_token,
                               logins=self.logins, audit=self.audit)
            http = await serve_http(host, port, self.metrics, self.healthy, auth=auth,
                                    require_token=c.metrics_require_token)
            self._listeners.append(http)
            bound = http.sockets[0].getsockname()
            self.addresses["metrics"] = _host_port(bound)
        if self.events is not None:
            self.addresses["events"] = self.events.endpoint
        self._timers = [loop.create_task(self._watchdog()), loop.create_task(self._sweeper())]
        return self.addresses

    def _tls_context(self) -> ssl.SSLContext:
        """The listeners' TLS; the private key held to the rules of every other secret (0600, ours,
        no symbolic link): whoever reads it can pose as this server and collect tenant tokens."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # a payload piece handed to TLS is encrypted at once (connection.py), never held for a renegotiation
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        key = self.config.tls_key
        fd = open_private_file(key, "tls_key", "point tls_key at the key file itself",
                               why="whoever reads it can pose as this server")
        try:
            # the file checked, not whatever the path names by now (Linux: /proc/self/fd)
            checked = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else key
            ctx.load_cert_chain(self.config.tls_cert, checked)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls_cert {self.config.tls_cert!r} / tls_key {key!r}: cannot load them ({exc}); "
                              f"give a PEM certificate chain and its PEM private key") from None
        finally:
            os.close(fd)
        return ctx

    async def _watchdog(self) -> None:
        idle, frame = self.config.idle_timeout_s, self.config.frame_timeout_s
        period = max(0.05, min(1.0, idle / 4, frame / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in self.admission.overdue(now):
                self.metrics.protocol_errors.labels("TIMEOUT").inc()
                conn.fail(ErrorCode.TIMEOUT, f"no HELLO within {self.admission.hello_timeout_s:g} s; closing")
            for conn in [c for c in self.connections if c.expired(now, idle, frame)]:
                self.metrics.protocol_errors.labels("TIMEOUT").inc()
                conn.timeout()

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.config.sweep_interval_s))
            try:  # on the I/O threads: expired blocks may be files to unlink
                await self.service.sweep()
            except Exception:  # noqa: BLE001 - retention retries at the next sweep
                log.exception("retention sweep failed")

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def serve_until_stopped(self) -> None:
        await self._stopping.wait()
        await self.close()

    async def close(self) -> None:
        for t in self._timers:
            t.cancel()
        for srv in self._listeners:
            srv.close()
        for conn in list(self.connections):
            conn.close()
        await self._tasks_ended()
        for srv in self._listeners:
            try:
                await asyncio.wait_for(srv.wait_closed(), 2)
            except asyncio.TimeoutError:
                pass
        for path, dev, ino in self._unix_paths:
            try:
                st = os.stat(path)
                # Only the socket this server bound: another server may have taken the path since
                # (a restart begun before this one stopped), and its socket is not ours to remove.
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(path)
            except OSError:
                pass
        self.service.close()  # (runs what the I/O threads have queued)
        # Connections are gone: copy what only DRAM holds to disk, within the configured time.
        self.shutdown_report = await asyncio.get_running_loop().run_in_executor(None, self._shutdown_flush)
        if self.events is not None:
            self.events.close()
        self.audit.close()

    async def _tasks_ended(self) -> None:
        """Cancel the connections' tasks and the timers, and wait for them to end, before the I/O
        threads are shut down: a task left running went on when they were gone (a DELETE's next
        job, an upload's reservation) and failed with a traceback ("cannot schedule new futures
        after shutdown"). A cancelled request ends at its next await; its I/O job already under
        way still runs before the threads stop."""
        tasks = [t for t in self._timers if not t.done()]
        tasks += [c.task for c in list(self.connections) if c.task is not None and not c.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=TASKS_END_S)
            if stuck:
                log.warning("%d tasks did not end within %g s of the stop", len(stuck), TASKS_END_S)

    def _shutdown_flush(self) -> dict:
        """Copy down every indexed block only DRAM holds (at most ``shutdown_flush_timeout_s``),
        close the store; "dropped" counts the blocks still only in DRAM then (lost)."""
        t0 = time.monotonic()
        limit = self.config.shutdown_flush_timeout_s
        if self.spill is None:  # no disk: nothing is written behind (a fleet only takes evictions)
            cleared = {}
            if self.config.mooncake_master and self.fleet is None:
                # No state directory, no fleet journal: a restarted server could neither serve, erase
                # nor expire what it placed in the fleet, so it goes now. (A crash leaves it to the
                # fleet's own eviction.)
                from kvtier.server.fleet import clear_fleet

                removed, left = clear_fleet(self.store.tiers[-1], self.index, limit)
                cleared = {"fleet_deleted": removed, "fleet_left": left}
            r = self.store.close(flush_timeout_s=max(0.0, limit - (time.monotonic() - t0)))
            return {"flushed": r.flushed, "dropped": r.dropped, "seconds": round(time.monotonic() - t0, 3),
                    **cleared}
        flushed = self.store.flush_dirty(limit).flushed
        unsaved = self._dram_only()
        if unsaved:  # a copy that failed (or a mark lost some other way): once more
            self.store.schedule_writeback(unsaved)
            flushed += self.store.flush_dirty(max(0.0, limit - (time.monotonic() - t0))).flushed
            unsaved = self._dram_only()
        r = self.store.close(flush_timeout_s=0)  # what is still queued is in `unsaved`
        return {"flushed": flushed + r.flushed, "dropped": len(unsaved),
                "seconds": round(time.monotonic() - t0, 3)}

    def _dram_only(self) -> list[bytes]:
        """The indexed blocks the DRAM pool holds that no lower tier does."""
        missing = [k for k in self.host.keys() if self.index.get(k) is not None]
        for tier in self.store.tiers[1:]:
            if not missing:
                break
            missing = [k for k, held in zip(missing, tier.contains_many(missing)) if not held]
        return missing


#: descriptors a server holds besides its client connections: stdio, the event loop's, the listeners,
#: the metrics endpoint and its scrapers, KV events sockets, the audit log, the state files, the disk
#: files the I/O threads have open, a Mooncake client's
RESERVED_DESCRIPTORS = 64


def _open_file_limit_warning(config: ServerConfig, open_file_limit: int) -> str | None:
    """Why ``open_file_limit`` (the soft ``RLIMIT_NOFILE``) is too low for the connections the
    config admits, or None: past it every accept fails and new clients are reset unheard."""
    needed = config.max_connections + config.max_unauthenticated + RESERVED_DESCRIPTORS
    if open_file_limit == resource.RLIM_INFINITY or needed <= open_file_limit:
        return None
    return (f"the open-file limit is {open_file_limit}, below the {needed} descriptors the connection limits "
            f"take (max_connections {config.max_connections} + max_unauthenticated {config.max_unauthenticated} "
            f"+ {RESERVED_DESCRIPTORS} the server holds itself): past it new clients are reset before their "
            f"HELLO, unlogged. Raise the hard limit (systemd LimitNOFILE=, ulimit -Hn; the server raises its "
            f"soft limit to it) or lower max_connections / max_unauthenticated")


def _start_warnings(config: ServerConfig, open_file_limit: int) -> list[str]:
    """What the start line warns about (the log then does not repeat it)."""
    lines = []
    too_few_files = _open_file_limit_warning(config, open_file_limit)
    if too_few_files:
        lines.append(too_few_files)
    if config.disk_dir and not config.encrypt_at_rest and safety.first_time("server-plaintext", config.disk_dir):
        lines.append(safety.server_plaintext_message(config.disk_dir))
    cleartext = [url for url in config.listen if cleartext_beyond_host(url)]
    if cleartext:  # only reached with insecure_plaintext (the config refuses them otherwise)
        lines.append(f"listening in cleartext on {', '.join(cleartext)} (insecure_plaintext): tokens and KV "
                     f"blocks cross the network readable; use tls:// with tls_cert and tls_key")
    return lines


def run(config: ServerConfig, ready: Callable[[dict], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM. ``ready`` gets the bound addresses once listening."""
    # (process-wide, hence here and not in Server, which tests also run inside their own process)
    open_file_limit = raise_open_file_limit()

    async def main() -> None:
        for line in _start_warnings(config, open_file_limit):
            print(f"kvtier serve: WARNING: {line}", file=sys.stderr, flush=True)
        try:
            server = Server(config)
        except ConfigError as exc:  # e.g. a spill secret or runtime state file to fix
            print(f"kvtier serve: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        if server.spill is not None:
            r = server.recovered
            print(f"kvtier serve: recovered {r['recovered']} blocks from {config.disk_dir} in {r['seconds']} s "
                  f"(deleted: {r['rejected']} failing authentication, {r['unattributed']} unattributed, "
                  f"{r['unknown_owner']} of unconfigured tenants)", file=sys.stderr, flush=True)
        if server.fleet is not None:
            f = server.recovered["fleet"]
            print(f"kvtier serve: indexed again {f['recovered']} blocks placed in the Mooncake fleet "
                  f"({server.fleet.journal.path}; {f['gone']} the fleet no longer holds; deleted: {f['rejected']} "
                  f"failing authentication, {f['unknown_owner']} of unconfigured tenants, {f['erased']} erased)",
                  file=sys.stderr, flush=True)
        addresses = await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_stop)
        if ready is not None:
            ready(addresses)
        await server.serve_until_stopped()
        r = server.shutdown_report
        cleared = (f"; deleted {r['fleet_deleted']} blocks from the Mooncake fleet (no state_dir: a restart could "
                   f"not reach them), {r['fleet_left']} left to its eviction" if "fleet_deleted" in r else "")
        print(f"kvtier serve: stopped; flushed {r['flushed']}, dropped {r['dropped']} blocks "
              f"in {r['seconds']} s{cleared}", file=sys.stderr, flush=True)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the server extra
        asyncio.run(main())
    else:
        uvloop.run(main())
