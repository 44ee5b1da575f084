"""Quotas and retention: small policy objects that decide; the server deletes.

* A quota is bytes of host pool per tenant: each block is charged its
  *footprint* (what the pool really spends on it, :meth:`HostTier.footprint
  <kvtier.tiers.host.HostTier.footprint>`), not its payload, so that a tenant
  cannot take more of the pool than its quota by storing many tiny blocks. A put
  that would take a tenant over its quota evicts that tenant's own least
  recently used blocks (:meth:`Governance.quota_victims`); other tenants are
  never touched. The service asks once the payload is verified, just before the
  block is committed and indexed: an upload that fails evicts nothing, and
  concurrent uploads cannot each count on the room that one eviction made (an
  upload in flight holds its pool slot, bounded by the service's in-flight caps,
  not quota). Only where the pool has no room for the block does its reservation
  evict those victims' DRAM copies first, before the pool's least recently used
  blocks (another tenant's): demoted if a tier lies below, lost otherwise, even
  if the upload then fails. A block larger than the whole quota is refused. Finding the
  victims walks the tenant's LRU order only as far as the bytes it must free
  (O(victims)): the walk runs on the event loop under the index lock, and a
  walk over every block stalled all tenants (335 ms per PUT at 500 k blocks).
* A block written into a shared namespace is charged to both *accounts*: the
  shared namespace (its owner) and the tenant that wrote it, so a publisher's
  quota covers what it publishes; when the writer is over its quota, its least
  recently used blocks -- its own or those it published -- make room. Erasing
  a tenant does not delete what it published: those blocks belong to the
  shared namespace (erase that namespace's owner, ``shared/NAME``, for them).
* Retention is a TTL per tenant, per tenant namespace, or per shared namespace
  (the namespace TTL wins over the tenant's). Expired blocks are misses at once
  (and unlisted) and are deleted by the server's sweeper. A tenant TTL of 0 is
  none; a *namespace* TTL of 0 means that namespace never expires, even under a
  tenant TTL; a namespace without one (``null`` through the admin API removes
  it) follows its tenant's. (A 0 once meant "no override" for a namespace too,
  so a tenant TTL still deleted the blocks of a namespace set to "no expiry".
  Runtime overrides saved then hold ``null`` for it, which still means "follow
  the tenant", as it did.)

Quotas and TTLs start from the config and can be changed at run time through the
admin API (:meth:`set_quota`, :meth:`set_ttl`). Changes are not written back to
the config file but persisted as runtime overrides
(:mod:`kvtier.server.runtime_state`), which a restarted server applies over the
config: runtime overrides win. Thread safe (a dict replace is atomic; reads take
no lock).
"""

from __future__ import annotations

import threading

from kvtier.server.config import SHARED_PREFIX, ServerConfig
from kvtier.server.index import BlockIndex
from kvtier.server.runtime_state import RuntimeState


class Governance:
    def __init__(self, config: ServerConfig, state: RuntimeState | None = None) -> None:
        self._state = state if state is not None else RuntimeState(None)
        self._quota: dict[str, int] = {t.name: t.quota_bytes for t in config.tenants if t.quota_bytes}
        self._tenant_ttl: dict[str, float] = {t.name: t.ttl_s for t in config.tenants if t.ttl_s}
        # (owner, namespace) -> seconds; 0: never expires (see ttl)
        self._ns_ttl: dict[tuple[str, str], float] = {
            (t.name, ns): ttl for t in config.tenants for ns, ttl in t.namespace_ttl_s.items()
        }
        for s in config.shared:
            if s.ttl_s:
                self._ns_ttl[(SHARED_PREFIX + s.name, s.name)] = s.ttl_s
        # Footprint charging: the index counts payload bytes per account; what a block
        # takes on top of its payload (page rounding, a size class's chunk) is kept
        # here, from its store (:meth:`charge`) to its removal (:meth:`release`). Every
        # indexed block is charged: at its PUT's commit, or when a start indexes it again
        # from disk or the fleet journal (Server._recover), so a restart changes no charge -- a
        # shared block's writer's neither (its payer is kept with the block), unless the config
        # dropped that tenant from the namespace's writers meanwhile, or an older version wrote
        # the block (no payer kept): then its owner alone is charged.
        self._extra_lock = threading.Lock()  # eviction hooks release from I/O threads
        self._extra: dict[bytes, tuple[tuple[str, ...], int]] = {}
        self._extra_by_account: dict[str, int] = {}
        # Runtime overrides win over the config file (a None there removed a configured limit).
        for owner, quota in self._state.quota.items():
            self._apply_quota(owner, quota)
        for owner, ttl in self._state.tenant_ttl_s.items():
            self._apply_ttl(owner, ttl, None)
        for (owner, ns), ttl in self._state.namespace_ttl_s.items():
            self._apply_ttl(owner, ttl, ns)

    # -- decisions -------------------------------------------------------------------
    def quota(self, owner: str) -> int | None:
        return self._quota.get(owner)

    def ttl(self, owner: str, namespace: str) -> float | None:
        """Seconds a block of ``owner``'s ``namespace`` lives; None: it never expires."""
        ttl = self._ns_ttl.get((owner, namespace))
        if ttl is None:
            return self._tenant_ttl.get(owner)
        return ttl or None  # 0: this namespace never expires, whatever its tenant's TTL

    def is_expired(self, owner: str, namespace: str, created: float, now: float) -> bool:
        ttl = self.ttl(owner, namespace)
        return ttl is not None and now - created > ttl

    def admits(self, account: str, footprint: int) -> bool:
        """False if one block taking ``footprint`` bytes can never fit ``account``'s quota."""
        quota = self._quota.get(account)
        return quota is None or footprint <= quota

    def charged(self, index: BlockIndex, account: str) -> int:
        """Bytes charged to ``account``: the footprints of its blocks (for a tenant, also of the
        shared blocks it wrote)."""
        return index.charged(account) + self._extra_by_account.get(account, 0)

    def extra(self, skey: bytes) -> int:
        """What a block takes in the pool beyond its payload (0 if not charged)."""
        got = self._extra.get(skey)
        return got[1] if got is not None else 0

    def quota_victims(self, index: BlockIndex, account: str, footprint: int) -> list[bytes]:
        """The account's blocks to delete, least recently used first, so that a block taking
        ``footprint`` bytes more fits; the walk stops at the last one needed."""
        quota = self._quota.get(account)
        if quota is None:
            return []
        return index.victims(account, self.charged(index, account) + footprint - quota, self.extra)

    # -- footprint charges (the service calls these as blocks enter and leave the index) --
    def charge(self, skey: bytes, accounts: tuple[str, ...] | str, nbytes: int, footprint: int) -> None:
        """A block of ``nbytes`` payload taking ``footprint`` bytes was recorded, charged to ``accounts``
        (its :attr:`~kvtier.server.index.BlockEntry.accounts`)."""
        extra = footprint - nbytes
        if extra <= 0:
            return
        if isinstance(accounts, str):
            accounts = (accounts,)
        with self._extra_lock:
            if skey in self._extra:
                return
            self._extra[skey] = (accounts, extra)
            for account in accounts:
                self._extra_by_account[account] = self._extra_by_account.get(account, 0) + extra

    def release(self, skey: bytes) -> None:
        """The block left the index (deleted, expired, evicted from the last tier)."""
        with self._extra_lock:
            got = self._extra.pop(skey, None)
            if got is None:
                return
            accounts, extra = got
            for account in accounts:
                left = self._extra_by_account[account] - extra
                if left:
                    self._extra_by_account[account] = left
                else:
                    del self._extra_by_account[account]

    # -- changes (admin API) ---------------------------------------------------------
    def set_quota(self, owner: str, quota_bytes: int | None) -> None:
        """Change a quota now and persist it (a restart keeps it)."""
        self._state.set_quota(owner, quota_bytes or None)
        self._apply_quota(owner, quota_bytes)

    def set_ttl(self, owner: str, ttl_s: float | None, namespace: str | None = None) -> None:
        """Change a TTL now and persist it (a restart keeps it). A tenant's: 0 or None, none. A
        namespace's: 0, it never expires (kept as 0); None, it follows its tenant's (kept as null,
        which also wins over the config file's value for it)."""
        self._state.set_ttl(owner, ttl_s if namespace is not None else ttl_s or None, namespace)
        self._apply_ttl(owner, ttl_s, namespace)

    def forget_namespace_ttl(self, owner: str, namespace: str) -> None:
        """Remove ``owner``'s own TTL entry for ``namespace`` now and from the runtime state (not kept
        as a null: see :meth:`RuntimeState.forget_namespace_ttl
        <kvtier.server.runtime_state.RuntimeState.forget_namespace_ttl>`)."""
        self._state.forget_namespace_ttl(owner, namespace)
        self._apply_ttl(owner, None, namespace)

    def _apply_quota(self, owner: str, quota_bytes: int | None) -> None:
        quotas = dict(self._quota)
        if quota_bytes:
            quotas[owner] = quota_bytes
        else:
            quotas.pop(owner, None)
        self._quota = quotas

    def _apply_ttl(self, owner: str, ttl_s: float | None, namespace: str | None) -> None:
        if namespace is None:
            table = dict(self._tenant_ttl)
            key: object = owner
            ttl_s = ttl_s or None  # a tenant TTL of 0: none
        else:
            table = dict(self._ns_ttl)
            key = (owner, namespace)  # (a namespace TTL of 0 is kept: it never expires)
        if ttl_s is not None:
            table[key] = ttl_s
        else:
            table.pop(key, None)
        if namespace is None:
            self._tenant_ttl = table
        else:
            self._ns_ttl = table

    def describe(self) -> dict:
        return {
            "quota_bytes": dict(self._quota),
            "tenant_ttl_s": dict(self._tenant_ttl),
            "namespace_ttl_s": {f"{o}:{n}": t for (o, n), t in self._ns_ttl.items()},
        }
