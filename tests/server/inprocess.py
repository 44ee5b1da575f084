"""``kvtier serve``'s real ``Server`` on a thread of the test process, over a real TCP socket.

In process, its service stays reachable: a test can slow or hold its tier deletions (standing in
for a slow disk or fleet, or a loaded CI machine) and read its state, while clients talk to it
with the real :class:`~kvtier.tiers.remote.RemoteTier`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from kvtier.server.config import load_config
from kvtier.server.launch import write_config
from kvtier.server.server import Server
from kvtier.tiers.remote import RemoteTier
from tests.server.harness import SHARED, TOKENS, fresh_namespace, tenants

PAGE = 4096
POOL = 4 << 20


class InProcessServer:
    def __init__(self, tmp_path, limits: dict | None = None, **server):
        """``limits``: per tenant, its extra settings (``{"acme": {"quota": ...}}``); ``server``: settings."""
        path = str(tmp_path / "kvtier.toml")
        write_config(path, {"listen": ["tcp://127.0.0.1:0"], "capacity": POOL, "max_block": "256KiB", **server},
                     tenants(**(limits or {})), SHARED, TOKENS["admin"])
        self.server = Server(load_config(path, env={}))
        self.service = self.server.service
        self._stopping = threading.Event()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main():
            self.addresses = await self.server.start()
            started.set()
            await self.server.serve_until_stopped()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(20), "the in-process server did not start"
        self.url = self.addresses["listen"][0]

    def before_deletions(self, before: Callable[[bytes], None]) -> list[bytes]:
        """Call ``before(storage key)`` ahead of each deletion of a block from the tiers; the keys
        whose deletion has run, in order (a list the server's I/O threads append to)."""
        real = self.service._delete_from_tiers
        ran: list[bytes] = []

        def deleting(skey, owner):
            before(skey)
            try:
                return real(skey, owner)
            finally:
                ran.append(skey)

        self.service._delete_from_tiers = deleting
        return ran

    def slow_deletions(self, seconds: float) -> list[bytes]:
        """Each deletion takes ``seconds`` more, until :meth:`stop` (which would wait for them all)."""
        return self.before_deletions(lambda _: self._stopping.wait(seconds))

    def remote(self, who: str, namespace: str | None = None, **kw) -> RemoteTier:
        return RemoteTier(self.url, TOKENS[who], namespace=namespace or fresh_namespace(), **kw)

    def stop(self):
        self._stopping.set()
        self.loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the in-process server did not stop"
