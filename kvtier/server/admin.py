"""The admin API: usage, stats, integrity check, erasure, quotas and TTLs -- for the admin token only.

Requests are ADMIN frames ``{"cmd": NAME, "args": {...}}`` (see
:mod:`kvtier.tiers.remote_protocol`); ``kvtier admin`` is the command-line
client. Every call, refused or not, is written to the audit log (one made with
a tenant's token too, by the service: :func:`admin_request_fields`, its command and argument
names only, a few a minute per tenant: :meth:`~kvtier.server.audit.AuditLog.write_refusal`).
Commands are a table (name → method); a bad argument is an
``{"ok": false, "error": …}`` reply naming the fix, never a dropped connection.
Erasure runs on the I/O threads (a tenant may have many blocks on disk); with a
disk spill or a fleet journal it is recorded first (a tombstone in the runtime
state: it outlasts a restart, and neither an old copy of the files nor the
journal's record of a block whose removal the fleet owes brings it back), and the
fleet journal, if any, is written anew after it (no record of an erased block
stays in it; one whose removal a Mooncake fleet owes -- it did not answer -- goes
once the removal lands, and the reply counts that block ``refused`` meanwhile);
the rest is immediate. A tenant taken out of the config is still erased whole (its keys
shredded, its tombstone recorded) when the call says so (``"offboarded": true``) and the key store
holds its keys or this start found its blocks on disk (:meth:`AdminAPI._erasable_owner`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from functools import partial

from kvtier.server.config import SHARED_PREFIX, check_namespace, check_tenant_namespace
from kvtier.server.fleet import journaled_fleet_in
from kvtier.server.fleet_journal import journal_under
from kvtier.server.index import BlockEntry
from kvtier.server.io_lanes import ADMIN_LANE
from kvtier.server.recovery import key_store_holds
from kvtier.tiers.base import RefusedRemoval
from kvtier.tiers.remote_protocol import ErrorCode, ProtocolError, unpack_msgpack

log = logging.getLogger(__name__)


class AdminAPI:
    def __init__(self, service) -> None:
        self.svc = service
        cfg = service.config
        self.owners = {t.name for t in cfg.tenants} | {SHARED_PREFIX + s.name for s in cfg.shared}
        self._commands = {
            "usage": self.usage,
            "stats": self.stats,
            "check": self.check,
            "erase": self.erase,
            "set_quota": self.set_quota,
            "set_ttl": self.set_ttl,
        }

    async def call(self, peer: str, meta: bytes) -> dict:
        result, ok = {}, False  # (a call that raised: audited as failed; the client gets an error code)
        asked = None  # what the call asked, once decoded
        try:
            req = unpack_msgpack(meta, "ADMIN")
            cmd, args = req.get("cmd"), req.get("args") or {}
            if not isinstance(args, dict):
                raise ProtocolError(ErrorCode.BAD_META, "ADMIN args must be a map")
            asked = {"cmd": client_text(cmd, 40), "args": _printable(args)}
            command = self._commands.get(cmd) if isinstance(cmd, str) else None
            if command is None:
                raise ValueError(f"unknown admin command {client_text(cmd, 40)!r}; "
                                 f"use one of {sorted(self._commands)}")
            result, ok = await _outcome(command, args), True
        except (KeyError, ValueError, TypeError) as exc:
            result = {"error": str(exc)}
        finally:
            # Every call, one that raised too: a command may have changed things before it failed (an
            # erase deletes blocks before it shreds keys), and the audit trail must not miss it.
            self._audit(peer, asked or admin_request_fields(meta), ok, result)
        return {"ok": ok, **result}

    def _audit(self, peer: str, asked: dict, ok: bool, result: dict) -> None:
        # (an erase's outcome whole: a partly refused one must not read as done in the audit trail)
        outcome = {k: result[k] for k in ("erased", "refused", "keys_shredded", "complete") if ok and k in result}
        self.svc.audit.write("admin", peer=peer, ok=ok, **asked, **outcome)

    # -- commands ---------------------------------------------------------------------------
    def usage(self, args: dict) -> dict:
        """Per owner: payload ``bytes`` and ``blocks`` held, and ``charged_bytes`` beside its
        ``quota``: the pool footprints the quota is checked against (a 64 B block is charged a
        page; for a tenant, the shared blocks it wrote too), as the tenant's own STATS says."""
        index, gov = self.svc.index, self.svc.gov
        usage = index.usage_by_owner()
        return {
            "usage": {
                o: {"bytes": usage.get(o, (0, 0))[0], "blocks": usage.get(o, (0, 0))[1],
                    "charged_bytes": gov.charged(index, o), "quota": gov.quota(o)}
                for o in sorted(self.owners | set(usage))
            },
            "policy": gov.describe(),
        }

    def stats(self, args: dict) -> dict:
        idx = self.svc.index
        spill = self.svc.spill
        return {"store": self.svc.store.stats(), "blocks": len(idx), "bytes": idx.total_bytes,
                "recovered": spill.last_rebuild if spill is not None else None,
                "expirations": int(self.svc.metrics.registry.get_sample_value("kvtier_expirations_total") or 0)}

    def check(self, args: dict) -> dict:
        try:
            self.svc.index.check_integrity()
            self.svc.store.check_integrity()
        except AssertionError as exc:
            return {"consistent": False, "problem": str(exc)}
        return {"consistent": True, "blocks": len(self.svc.index)}

    async def erase(self, args: dict) -> dict:
        owner = await self._erasable_owner(args)
        namespace, session = _opt_str(args, "namespace"), _opt_str(args, "session")
        if owner not in self.owners and (namespace is not None or session is not None):
            raise ValueError(f"tenant {owner!r} is no longer configured: erase it whole (leave out namespace and "
                             f"session), which shreds its keys")
        # On the event loop, as every commit: the blocks indexed now are those created by now. Their
        # entries, not only their keys: a block deleted and put again while the erasure's jobs work
        # through the list (acknowledged, created after ``erased_at``) is another entry, left alone.
        index = self.svc.index
        selected = [(skey, entry) for skey in index.select(owner, namespace=namespace, session=session)
                    if (entry := index.get(skey)) is not None]
        erased_at = time.time()
        io = self.svc.io
        tombstones = self._tombstones()
        if tombstones is not None and session != "":  # ("": no session is named so; erases nothing)
            # The tombstone first: an old copy of these files (a backup put back, a crash before
            # their unlink) must not bring them back at the next start (kvtier/server/recovery.py),
            # nor a fleet journal's record of a block whose removal the fleet owes (kvtier/server/fleet.py).
            try:
                await io.run(ADMIN_LANE, tombstones.record_erasure, owner, namespace, session, erased_at)
            except OSError as exc:
                raise ValueError(f"not erased: the erasure could not be recorded in the runtime state ({exc}); "
                                 f"check the state directory (space, permissions)") from None
        refusals: list[RefusedRemoval] = []
        # (other lanes' jobs in between)
        results = await self.svc.in_jobs(ADMIN_LANE, selected, partial(self._erase_entry, refusals))
        erased, refused = results.count(True), results.count(False)
        self.svc.metrics.erasures.inc(erased)
        if self.svc.events is not None:  # nor their names in the events' replay rings (after their "removed")
            self.svc.events.purge(owner, namespace, None if session is None else
                                  [(entry.namespace, entry.key) for _, entry in selected])
        # A copy a tier could not remove (a read-only disk, a Mooncake fleet that did not answer) is
        # no longer served, but it is not erased: said so, never counted as done (the tombstone above
        # keeps it from coming back at a restart).
        problems = [_not_removed(refused, refusals)] if refused else []
        if selected:  # (cheap where the journal holds no forgotten entry)
            problems += await io.run(ADMIN_LANE, self._compact_fleet_journal)
        shredded = None  # (no key store: nothing to shred, and the reply says nothing of keys)
        if self.svc.keyring is not None:
            shredded = False
            if namespace is None and session is None:
                shredded = await io.run(ADMIN_LANE, self._shred_keys, owner, problems)
        # ``complete: false`` (with the ``error`` saying what is left): a client need not know which
        # fields say an erasure is not done (``kvtier admin erase`` exits 3). Absent when it is done,
        # as before the field existed.
        failed = ({"refused": refused} if refused else {}) | (
            {"complete": False, "error": "; ".join(problems)} if problems else {})
        return {"erased": erased, **({} if shredded is None else {"keys_shredded": shredded}), **failed}

    def _shred_keys(self, owner: str, problems: list[str]) -> bool:
        """Crypto-shredding: whatever copy of the owner's sealed blocks survives anywhere (a file not
        yet unlinked, a backup) is noise from now on. Whether its keys were deleted; a key store that
        refuses (read-only, full) adds the problem to ``problems`` -- the blocks are erased by then,
        and the reply must say so beside it, not fail whole. On an I/O thread."""
        try:
            return self.svc.keyring.shred_tenant(owner)
        except OSError as exc:
            log.warning("erase of %s: its keys could not be shredded: %s", owner, exc)
            problems.append(f"keys not shredded ({exc}): {owner}'s blocks are erased, but a copy of them kept "
                            f"elsewhere (a backup) can still be opened with its keys; make the key store writable "
                            f"and erase {owner} again to shred them")
            return False

    def _tombstones(self):
        """Where an erasure is recorded to outlast a restart: the disk spill (its runtime state is the
        fleet journal's too), else the fleet journal; None where nothing is read back at a start."""
        return self.svc.spill if self.svc.spill is not None else journaled_fleet_in(self.svc.store.tiers)

    def _erase_entry(self, refusals: list[RefusedRemoval], selected: tuple[bytes, BlockEntry]) -> bool | None:
        """Erase a block the erasure selected if its entry is still the one indexed (see
        :meth:`Service.erase <kvtier.server.service.Service.erase>`); None (not erased) if it left
        meanwhile, or was put again since; False (copies not removed, added to ``refusals``) if a
        tier could not remove its copy. On an I/O thread."""
        skey, entry = selected
        return self.svc.erase(skey, only=entry, refusals=refusals)

    def _compact_fleet_journal(self) -> list[str]:
        """Write the fleet journal anew without the records the erasure forgot (their owner,
        namespace, session and client keys); the problem, if it could not be."""
        for tier in self.svc.store.tiers:
            journal = journal_under(tier)
            if journal is None:
                continue
            try:
                journal.compact()
            except OSError as exc:
                log.warning("fleet journal %s could not be written anew after an erasure: %s", journal.path, exc)
                return [f"the fleet journal {journal.path} could not be written anew ({exc}): the erased blocks' "
                        f"records stay in it until it can (at the next erasure or start); check state_dir"]
        return []

    def set_quota(self, args: dict) -> dict:
        owner = self._owner(args)
        quota = args.get("bytes")
        if quota is not None and (not isinstance(quota, int) or isinstance(quota, bool) or quota < 0):
            raise ValueError("bytes must be a non-negative integer (0 or null: no quota)")
        _persisted(self.svc.gov.set_quota, owner, quota)
        return {"quota": quota}

    def set_ttl(self, args: dict) -> dict:
        """``ttl_s``: seconds; 0, no expiry (a namespace's: even under its tenant's TTL); null, no
        TTL of its own (a namespace then follows its tenant's; a tenant has none). A shared space's
        TTL is its one namespace's; a tenant's on a ``shared/`` namespace is refused, but null, which
        only removes one an older version saved."""
        owner = self._owner(args)
        ttl, namespace = args.get("ttl_s"), _opt_str(args, "namespace")
        if ttl is not None and (not isinstance(ttl, (int, float)) or isinstance(ttl, bool)
                                or not math.isfinite(ttl) or ttl < 0):
            raise ValueError("ttl_s must be a finite non-negative number of seconds (0: no expiry, for a namespace "
                             "even under its tenant's TTL; null: none of its own, a namespace follows its tenant's)")
        if owner.startswith(SHARED_PREFIX):
            # A shared space has one namespace, its name, and its TTL lives in the namespace
            # table (which wins over the owner table): write there, or the change is a no-op.
            name = owner[len(SHARED_PREFIX):]
            if namespace not in (None, name):
                raise ValueError(f"{owner} has one namespace, {name!r}; leave namespace out")
            namespace = name
        elif namespace is not None and ttl is None and namespace.startswith(SHARED_PREFIX):
            # A tenant's TTL on a shared namespace never takes effect (its blocks are its owner's), but
            # an older version accepted and saved one: removing it is allowed -- nothing is set so.
            check_namespace(namespace)
            _persisted(self.svc.gov.forget_namespace_ttl, owner, namespace)
            return {"ttl_s": None}
        elif namespace is not None:
            check_tenant_namespace(namespace, owner)
        _persisted(self.svc.gov.set_ttl, owner, ttl, namespace)
        return {"ttl_s": ttl}

    def _owner(self, args: dict) -> str:
        owner = args.get("tenant")
        if not isinstance(owner, str) or owner not in self.owners:
            raise ValueError(f"unknown tenant {client_text(owner)!r}; known: {sorted(self.owners)}")
        return owner

    async def _erasable_owner(self, args: dict) -> str:
        """The owner an erase names: a configured one (:meth:`_owner`), or -- only with
        ``"offboarded": true`` -- one taken out of the config since that left something to erase:
        keys in the key store, or blocks the disk held at this start. Offboarding must not leave a
        tenant's keys behind for good: every surviving copy of its sealed blocks (a backup of
        disk_dir, the fleet) would stay readable. But a key store may be shared by several servers
        (``keystore_dir``), so holding a name's keys does not make it this server's: without the
        flag, a name not configured here is unknown (the error names the flag where there is
        something to shred), and an erase sent to the wrong server shreds nothing. A name that
        left nothing is unknown either way: no typo shreds anything."""
        owner, offboarded = args.get("tenant"), _opt_bool(args, "offboarded")
        if not isinstance(owner, str) or owner in self.owners or not _owner_shaped(owner):
            return self._owner(args)
        left_behind = await self.svc.io.run(ADMIN_LANE, self._left_behind, owner)
        if offboarded and left_behind:
            return owner
        raise ValueError(f"unknown tenant {owner!r}; known: {sorted(self.owners)}"
                         + (_OFFBOARDED_HINT.format(owner=owner) if left_behind and not offboarded else ""))

    def _left_behind(self, owner: str) -> bool:
        """Whether ``owner``, not configured, left keys in the key store or blocks on disk at this
        start. On an I/O thread (the key store is read)."""
        keyring, spill = self.svc.keyring, self.svc.spill
        return ((spill is not None and owner in spill.unconfigured_owners)
                or (keyring is not None and key_store_holds(keyring, owner)))


#: what an erase of a name not configured adds where the key store holds its keys (or the disk held
#: its blocks at this start) but the call did not say it was offboarded
_OFFBOARDED_HINT = ("; the key store holds keys of {owner!r} (or this start found its blocks on disk), which may be "
                    "another server's tenant sharing the key store: if {owner!r} was this server's and was taken out "
                    "of its config, erase it with --offboarded (\"offboarded\": true), which shreds its keys for "
                    "every server sharing the key store")

#: the most bytes the argument names of a refused ADMIN frame take in its audit line, escaped
REFUSED_ARGS_BYTES = 640


def admin_request_fields(meta: bytes) -> dict:
    """What an ADMIN frame asks, for the audit line of a refused one: its command and the *names* of
    its arguments (``cmd`` "<undecodable>" if the frame does not decode). Bounded whatever the frame:
    a name cut to 40 characters, the names to :data:`REFUSED_ARGS_BYTES` as JSON escapes them (a
    control character takes 6 bytes), those left out counted in ``args_left_out``; no values (a
    tenant would repeat a refused frame of 64 long strings at will)."""
    try:
        req = unpack_msgpack(meta, "ADMIN")
    except ProtocolError:
        return {"cmd": "<undecodable>"}
    args = req.get("args")
    names = [client_text(k, 40) for k in args] if isinstance(args, dict) else []
    kept = _fitting(names, REFUSED_ARGS_BYTES)
    return {"cmd": client_text(req.get("cmd"), 40), "args": kept,
            **({"args_left_out": len(names) - len(kept)} if len(kept) < len(names) else {})}


def _fitting(names: list[str], limit: int) -> list[str]:
    """The leading ``names`` whose JSON list takes at most ``limit`` bytes."""
    used = 2  # []
    for i, name in enumerate(names):
        used += len(json.dumps(name)) + 1
        if used > limit:
            return names[:i]
    return names


async def _outcome(command, args: dict) -> dict:
    """What an admin command answers, whether it runs on the event loop or is a coroutine."""
    result = command(args)
    return await result if asyncio.iscoroutine(result) else result


def _persisted(change, *args) -> None:
    """Run a governance change that persists itself; a save that fails leaves nothing changed
    (RuntimeState rolls back, Governance applies only after the save) and becomes a refusal."""
    try:
        change(*args)
    except OSError as exc:
        raise ValueError(f"not changed: the runtime overrides could not be saved ({exc}); "
                         f"check the state directory (space, permissions)") from None


def _not_removed(blocks: int, refusals: list[RefusedRemoval]) -> str:
    """What an erase reply says of the blocks a tier could not remove: where and why (the first copy
    of each cause, a few causes at most), and what becomes of them."""
    causes: dict[str, str] = {}  # why → where, the first copy's
    for r in refusals:
        causes.setdefault(r.error.strerror or str(r.error), r.path)
    said = "; ".join(f"{where}: {why}" for why, where in list(causes.items())[:3])
    return (f"{blocks} blocks could not be removed from a tier, so they are not erased ({said}): this server no "
            f"longer serves them, but a copy is left until the removal is done (a disk: make it writable and erase "
            f"again; a Mooncake fleet: retried until it lands; see the server's log)")


def _owner_shaped(name: str) -> bool:
    """Whether ``name`` has an owner's shape, a tenant's ``NAME`` or a shared space's ``shared/NAME``:
    a namespace's (:func:`check_namespace`)."""
    try:
        check_namespace(name)
    except ValueError:
        return False
    return True


def _opt_bool(args: dict, name: str) -> bool:
    """A flag argument: true, false, or absent (false)."""
    value = args.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false")
    return value


def _opt_str(args: dict, name: str) -> str | None:
    value = args.get(name)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string")
    return value


def _printable(args: dict) -> dict:
    plain = (int, float, bool, type(None))
    return {client_text(k, 40): (v if isinstance(v, plain) else client_text(v, 200)) for k, v in args.items()}


def client_text(value: object, limit: int = 80) -> str:
    """A value a client sent, for a log or audit line: a string cut to ``limit`` characters, anything
    else only its type's name. Never ``str()`` of it: a msgpack list nested 1,000 deep fits in a
    HELLO, and its ``str()`` raises RecursionError (a traceback and INTERNAL, not a refusal)."""
    if isinstance(value, str):
        return value[:limit]
    return f"<{type(value).__name__}>"
