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
        it did not; it may return early, and the tier discards the rest of the payload. A reason
        that is an :class:`Unverifiable` means the sink could not judge the block (not that
        it is bad): the tier answers :attr:`Status.MISS` and keeps the block."""


class Unverifiable(str):
    """A sink's verdict that it could not judge a payload -- it lacks the key the block was
    sealed under (say, a key another process made and this one cannot load) -- rather than
    found it bad. The block is a miss for this reader, and kept: a reader with the key opens it."""


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
        :attr:`Status.CORRUPT` where it did not, :attr:`Status.MISS` (block kept) where its
        verdict is :class:`Unverifiable`."""


class PieceReader:
    """Copies a source's pieces into buffers it is given, in order (a piece may span buffers):
    for tiers that must stage what they store (e.g. page-aligned for O_DIRECT)."""

    def __init__(self, source: PayloadSource) -> None:
        self._pieces = iter(source.pieces())
        self._piece = memoryview(b"")
        self._announced = source.nbytes
        self._taken = 0

    def fill(self, dst) -> None:
        """Fill all of ``dst`` with the next bytes; raises ValueError if the source runs dry."""
        out = memoryview(dst).cast("B")
        got = 0
        while got < out.nbytes:
            if not self._piece:
                piece = next(self._pieces, None)
                if piece is None:
                    made = self._taken + got
                    raise ValueError(f"payload source made {made} of the {self._announced} bytes it announced")
                self._piece = memoryview(piece).cast("B")
            k = min(self._piece.nbytes, out.nbytes - got)
            out[got : got + k] = self._piece[:k]
            self._piece = self._piece[k:]
            got += k
        self._taken += got

    def finish(self) -> None:
        """Raise ValueError if the source has more than was taken (it announced too little)."""
        if self._piece or next(self._pieces, None) is not None:
            raise ValueError(f"payload source made more than the {self._announced} bytes it announced")


class SinkFeeder:
    """Copies bytes it is handed into the views a sink asks for, in order, and keeps the sink's
    verdict: for tiers that read what they hold into staging first."""

    def __init__(self, sink: PayloadSink) -> None:
        self._pieces = sink.pieces()
        self._view = memoryview(b"")
        self._got = 0
        self._verdict: str | None = None
        self._done = False
        self._advance()

    def _advance(self) -> None:
        try:
            self._view = memoryview(next(self._pieces)).cast("B")
            self._got = 0
        except StopIteration as done:
            self._done, self._verdict = True, done.value

    def feed(self, data) -> None:
        src = memoryview(data).cast("B")
        while src.nbytes and not self._done:
            k = min(self._view.nbytes - self._got, src.nbytes)
            self._view[self._got : self._got + k] = src[:k]
            self._got += k
            src = src[k:]
            if self._got == self._view.nbytes:
                self._advance()
        if src.nbytes and self._verdict is None:
            self._verdict = "the reader stopped before the end of the block"

    def verdict(self) -> str | None:
        """The sink's verdict once everything was fed: None only if it took it all and verified it."""
        if not self._done:
            self._pieces.close()
            return "the reader asked for more than the block holds"
        return self._verdict
