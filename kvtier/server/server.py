"""``Server``: the shared pod tier -- listeners, the store behind them, timers, and shutdown.

One asyncio event loop (uvloop when installed) runs every connection, the
metrics endpoint and two timers: a watchdog that closes idle or stalled
connections, and a sweeper that deletes expired blocks. Disk I/O (lower-tier
reads, demotions during a put) runs on a small thread pool.

Storage is a :class:`~kvtier.store.tiered.TieredStore` of a
:class:`~kvtier.tiers.host.HostTier` pool and, if ``disk_dir`` is
set, a :class:`~kvtier.tiers.disk.DiskTier` that host evictions are demoted to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import stat
import time
from collections.abc import Callable

from kvtier.server.audit import AuditLog
from kvtier.server.auth import Authenticator
from kvtier.server.config import ServerConfig, events_subscriber_scopes, parse_listen
from kvtier.server.connection import Connection
from kvtier.server.governance import Governance
from kvtier.server.index import BlockIndex
from kvtier.server.metrics import ServerMetrics, serve_http, tier_and_tenant_families
from kvtier.server.service import Service
from kvtier.tiers.host import HostTier
from kvtier.store.tiered import TieredStore

log = logging.getLogger(__name__)


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.host = HostTier(config.capacity_bytes, config.max_block_bytes)
        self.index = BlockIndex()
        self.keyring = None
        tiers = [self.host]
        if config.disk_dir:
            from kvtier.tiers.disk import DiskTier

            disk = DiskTier(config.disk_dir, config.disk_capacity_bytes)
            tiers.append(self._sealed(disk) if config.encrypt_at_rest else disk)
        self.store = TieredStore(tiers)
        self.governance = Governance(config)
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
            keyring=self.keyring,
        )
        self.metrics.add_collector(lambda: tier_and_tenant_families(
            self.store, self.index, self.governance, lambda: self.events.emitted if self.events else 0))
        self.connections: set[Connection] = set()
        self._listeners: list[asyncio.AbstractServer] = []
        self._unix_paths: list[str] = []
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
        keystore = self.config.keystore_dir or os.path.join(self.config.disk_dir, "keys")
        self.keyring = Keyring(provider, keystore)

        def owner_of(skey: bytes) -> str | None:
            entry = self.index.get(skey)
            return entry.owner if entry is not None else None

        sealed = EncryptedTier(disk, self.keyring, tenant_of=owner_of)
        sealed.name = disk.name  # metrics and KV events name the medium
        return sealed

    # -- connections ----------------------------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        if len(self.connections) >= self.config.max_connections:
            return False
        self.connections.add(conn)
        self.metrics.connections.set(len(self.connections))
        return True

    def forget(self, conn: Connection) -> None:
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
                if os.path.exists(host) and stat.S_ISSOCK(os.stat(host).st_mode):
                    os.unlink(host)  # a stale socket of a previous run
                srv = await loop.create_unix_server(factory, path=host, backlog=1024)
                os.chmod(host, 0o660)
                self._unix_paths.append(host)
                urls.append(f"unix://{host}")
            else:
                tls = self._tls_context() if scheme == "tls" else None
                srv = await loop.create_server(factory, host, port, ssl=tls, backlog=1024, reuse_address=True)
                bound = srv.sockets[0].getsockname()
                urls.append(f"{scheme}://{bound[0]}:{bound[1]}")
            self._listeners.append(srv)
        self.addresses = {"listen": urls, "pid": os.getpid()}
        if self.config.metrics:
            _, host, port = parse_listen("tcp://" + self.config.metrics)
            http = await serve_http(host, port, self.metrics, self.healthy)
            self._listeners.append(http)
            bound = http.sockets[0].getsockname()
            self.addresses["metrics"] = f"{bound[0]}:{bound[1]}"
        if self.events is not None:
            self.addresses["events"] = self.events.endpoint
        self._timers = [loop.create_task(self._watchdog()), loop.create_task(self._sweeper())]
        return self.addresses

    def _tls_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return ctx

    async def _watchdog(self) -> None:
        idle, frame = self.config.idle_timeout_s, self.config.frame_timeout_s
        period = max(0.05, min(1.0, idle / 4, frame / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [c for c in self.connections if c.expired(now, idle, frame)]:
                self.metrics.protocol_errors.labels("TIMEOUT").inc()
                conn.timeout()

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.config.sweep_interval_s))
            try:  # on an I/O thread: expired blocks may be files to unlink
                await asyncio.get_running_loop().run_in_executor(self.service.io, self.service.sweep)
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
        for srv in self._listeners:
            try:
                await asyncio.wait_for(srv.wait_closed(), 2)
            except asyncio.TimeoutError:
                pass
        for path in self._unix_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self.service.close()
        if self.events is not None:
            self.events.close()
        self.audit.close()
        self.store.close()


def run(config: ServerConfig, ready: Callable[[dict], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM. ``ready`` gets the bound addresses once listening."""

    async def main() -> None:
        server = Server(config)
        addresses = await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_stop)
        if ready is not None:
            ready(addresses)
        await server.serve_until_stopped()

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the server extra
        asyncio.run(main())
    else:
        uvloop.run(main())
