"""Tier factories for the shared contract suite.

Each factory builds a fresh tier that holds about ``capacity_bytes`` of blocks
of ``block_nbytes`` bytes. Add one per tier; the suite runs every test on each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.tiers.base import Tier
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.host import HostTier


@dataclass(frozen=True)
class TierFactory:
    name: str
    make: Callable[[Path, int, int], Tier]
    #: False for tiers that may drop everything (null): only the "never wrong" half applies.
    retains: bool = True
    #: whether the tier evicts to stay within capacity (a remote server may own that policy)
    bounded: bool = True
    #: whether ``keys()`` lists client keys (an encrypted tier's names are one-way)
    lists_keys: bool = True
    #: whether ``on_evict`` reports victims (not out of an encrypted tier)
    reports_evictions: bool = True


def _host(tmp: Path, capacity: int, block: int) -> Tier:
    return HostTier(capacity, block)


def _faulty_host(tmp: Path, capacity: int, block: int) -> Tier:
    # No faults configured: the wrapper itself must keep the contract.
    return FaultyTier(HostTier(capacity, block))


def _null(tmp: Path, capacity: int, block: int) -> Tier:
    from kvtier.tiers.null import NullTier

    return NullTier()


def _encrypted_host(tmp: Path, capacity: int, block: int) -> Tier:
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp / "keys")
    slot = block + 4096  # room for the sealed header and tags
    return EncryptedTier(HostTier(capacity // block * slot, slot), keyring, "tenant", chunk_bytes=16384)


FACTORIES: list[TierFactory] = [
    TierFactory("host", _host),
    TierFactory("faulty-host", _faulty_host),
    TierFactory("null", _null, retains=False, bounded=False),
    TierFactory("encrypted-host", _encrypted_host, lists_keys=False, reports_evictions=False),
]


def _disk(tmp: Path, capacity: int, block: int) -> Tier:
    from kvtier.tiers.disk import DiskTier

    return DiskTier(tmp / "disk", capacity)


def _encrypted_disk(tmp: Path, capacity: int, block: int) -> Tier:
    # Sealed streams through the disk tier's staging: sealed / opened chunk by chunk as it writes / reads.
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp / "keys")
    return EncryptedTier(_disk(tmp, capacity + capacity // 8, block), keyring, "tenant", chunk_bytes=16384)


try:  # the disk tier lands separately; include it as soon as it exists
    import kvtier.tiers.disk  # noqa: F401

    FACTORIES.append(TierFactory("disk", _disk))
    FACTORIES.append(TierFactory("encrypted-disk", _encrypted_disk, lists_keys=False, reports_evictions=False))
except ImportError:
    pass


def _remote(tmp: Path, capacity: int, block: int) -> Tier:
    # One real `kvtier serve` process for the session (started on first use);
    # each tier gets a namespace of its own, so tests never see each other's blocks.
    from kvtier.tiers.remote import RemoteTier
    from tests.server.harness import TOKENS, fresh_namespace, shared_server

    return RemoteTier(shared_server().url, TOKENS["acme"], namespace=fresh_namespace("contract"))


def _encrypted_remote(tmp: Path, capacity: int, block: int) -> Tier:
    # End-to-end: sealed streams in two lanes over the real server.
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp / "keys")
    return EncryptedTier(_remote(tmp, capacity, block), keyring, "tenant", chunk_bytes=16384, streams=2)


try:  # needs the server extra (uvloop, msgpack, prometheus-client)
    import msgpack  # noqa: F401
    import uvloop  # noqa: F401

    FACTORIES.append(TierFactory("remote", _remote, bounded=False, reports_evictions=False))
    FACTORIES.append(TierFactory("encrypted-remote", _encrypted_remote, bounded=False, lists_keys=False,
                                 reports_evictions=False))
except ImportError:
    pass


def _mooncake(tmp: Path, capacity: int, block: int) -> Tier:
    # A real mooncake_master + two holder processes for the session (tests/tiers/mooncake_harness.py).
    from tests.tiers.mooncake_harness import make_tier

    # a deadline far above any healthy call on a loaded 2-core machine: the race test counts ERRORs
    return make_tier(timeout_s=10.0)


def _encrypted_mooncake(tmp: Path, capacity: int, block: int) -> Tier:
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp / "keys")
    return EncryptedTier(_mooncake(tmp, capacity, block), keyring, "tenant", chunk_bytes=16384)


try:  # needs the mooncake extra and libibverbs (make sysdeps)
    from tests.tiers.mooncake_harness import mooncake_available

    if mooncake_available() is None:
        FACTORIES.append(TierFactory("mooncake", _mooncake, bounded=False, lists_keys=False,
                                     reports_evictions=False))
        FACTORIES.append(TierFactory("encrypted-mooncake", _encrypted_mooncake, bounded=False, lists_keys=False,
                                     reports_evictions=False))
except ImportError:
    pass
