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


def _host(tmp: Path, capacity: int, block: int) -> Tier:
    return HostTier(capacity, block)


def _faulty_host(tmp: Path, capacity: int, block: int) -> Tier:
    # No faults configured: the wrapper itself must keep the contract.
    return FaultyTier(HostTier(capacity, block))


def _null(tmp: Path, capacity: int, block: int) -> Tier:
    from kvtier.tiers.null import NullTier

    return NullTier()


FACTORIES: list[TierFactory] = [
    TierFactory("host", _host),
    TierFactory("faulty-host", _faulty_host),
    TierFactory("null", _null, retains=False, bounded=False),
]


def _disk(tmp: Path, capacity: int, block: int) -> Tier:
    from kvtier.tiers.disk import DiskTier

    return DiskTier(tmp / "disk", capacity)


try:  # the disk tier lands separately; include it as soon as it exists
    import kvtier.tiers.disk  # noqa: F401

    FACTORIES.append(TierFactory("disk", _disk))
except ImportError:
    pass
