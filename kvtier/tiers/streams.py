"""Streamed payloads: blocks that a tier moves piece by piece, produced and consumed by the caller.

An encrypted tier seals a block chunk by chunk. Over a socket the cheapest way to
move it is to send each chunk the moment it is sealed, while it is still in
cache, and to open each chunk the moment it lands: no staging copy of the whole
sealed block, no second pass over it, no checksum on top of the AEAD tags. A tier
that can move blocks this way implements :class:`StreamingTier`.

Streamed payloads are *self-authenticating* (sealed AEAD blocks): a streaming
tier stores them without a checksum of its own and never verifies them; the
sink's verdict is the block's status. A plain ``get`` never returns a streamed
block (there is no checksum to verify); a stream may read any block, since its
sink authenticates whatever it gets (so blocks an encrypted tier staged and
stored with a checksum, e.g. on an older server, stay readable).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from typing import Protocol

from kvtier.core.keys import BlockKey
from kvtier.tiers.base import Status


class PayloadSource(Protocol):
    #: total bytes of all pieces
    nbytes: int

    def pieces(self) -> Iterator[memoryview]:
        """The payload in order, ``nbytes`` in all. A piece is valid only until the next one is
        asked for (sources reuse one buffer), so a tier sends or copies each before asking on."""


class PayloadSink(Protocol):
    #: the payload size the reader expects (a stored block of another size is not read)
    nbytes: int

    def pieces(self) -> Generator[memoryview, None, str | None]:
        """Writable views that the tier fills with the payload, in order, each before it asks
        for the next. Returns ``None`` once the last is filled and the payload verified, or why
        it did not; it may return early, and the tier discards the rest of the payload."""


class StreamingTier(ABC):
    """The optional capability of moving :class:`PayloadSource` / :class:`PayloadSink` payloads."""

    @abstractmethod
    def streams_available(self) -> bool:
        """Whether streamed payloads can be moved now (e.g. the server supports them)."""

    @abstractmethod
    def put_streams(
        self,
        keys: Sequence[BlockKey],
        sources: Sequence[PayloadSource],
        *,
        parents: Sequence[BlockKey | None] | None = None,
    ) -> list[Status]:
        """Store each source's payload under its key; one status per key (a present key is OK)."""

    @abstractmethod
    def get_streams(self, keys: Sequence[BlockKey], sinks: Sequence[PayloadSink]) -> list[Status]:
        """Feed each stored payload to its sink: OK only where the sink verified it,
        :attr:`Status.CORRUPT` where it did not."""
