"""Request traces in the Mooncake format (FAST '25): one JSON object a line.

``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens),
``hash_ids``: one id per ``block_tokens``-token block of the prompt; equal ids mean an
equal prefix up to and including that block, so a hash id *is* a block identity and
the simulator needs no token text.

Hash ids are read as prefixes: a trace whose ids name block contents instead (an id after
more than one parent, or twice in one prompt: a natural export of one's own logs) is
re-keyed on load, each ``(parent, id)`` pair under a later parent given a fresh id, so that
every hit count in kvtier stays a prefix hit, as engines' chained block hashes count them.
A trace of chained ids (the published ones) is read unchanged.

Arrival times are read relative to the trace's first request: a window cut from a longer
trace, or one exported with absolute or negative times, is the same workload and gives the
same figures. A file may be gzipped and may start with a UTF-8 byte-order mark.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import math
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

#: a trace file to use instead of the shared one (tests point it elsewhere to run as on a clean clone)
TRACE_ENV = "KVTIER_TRACE"
#: Where the project keeps the published trace: beside the repository, never inside it
#: (tests/data holds only a 500-request slice of it, so that no test needs it).
TRACE_HINT = ("get conversation_trace.jsonl from the Mooncake repository (kvcache-ai/Mooncake, "
              "FAST25-release/traces/) and put it in ../shared/data/traces/")
#: a gzip stream's first two bytes: a ``.jsonl.gz`` trace is read as it is, whatever its name
GZIP_MAGIC = b"\x1f\x8b"
#: what the block-count error advises where the caller does not say (simulate, plan workers)
BLOCK_SIZE_HINT = "set block_tokens in the --cluster JSON to the trace's block size"
#: timestamps this close on average, read as milliseconds, are taken for seconds: a mean load
#: above 200 requests a second, which no published conversation trace comes near (Mooncake's:
#: 3.4 a second), while a service's stamps in seconds are this close from one request every
#: 5 s up. (0.1 s, 10 requests a second, told busy float-millisecond exports to multiply.)
SECONDS_SUSPECT_GAP_S = 0.005
#: ... if most of the nonzero stamps are fractional: float seconds at millisecond resolution
#: are whole one time in 1,000 (x.000), at 0.1 s one in 10; whole stamps are the format's own
SECONDS_SUSPECT_FRACTIONAL_SHARE = 0.75
#: ... or, whole, if there are this many: a handful 1 ms apart is a hand-written test trace
SECONDS_SUSPECT_REQUESTS = 100


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    block_tokens: int
    source: str = ""
    #: how the file was read where it is not plain (ids re-keyed, timestamps that look like
    #: seconds): one line each, which :func:`load_trace` prints on stderr
    notes: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def block_token_counts(self, request: TraceRequest) -> list[int]:
        """Tokens in each block of ``request``: full blocks, then the remainder."""
        n, b = request.input_tokens, self.block_tokens
        return [min(b, n - i * b) for i in range(len(request.blocks))]

    def head(self, count: int) -> "Trace":
        return Trace(self.requests[:count], self.block_tokens, self.source, self.notes)


def parse_trace_lines(lines, block_tokens: int = 512, source: str = "",
                      block_size_hint: str = BLOCK_SIZE_HINT) -> Trace:
    """Parse Mooncake-format lines; raise :class:`ConfigError` naming the line that is wrong.
    ``block_size_hint``: how the caller's user sets ``block_tokens``, named when a line's hash
    ids do not fit it."""
    name = source or "trace"
    requests = []
    whole_stamps = nonzero_stamps = 0   # raw timestamps: a trace in seconds has fractional ones
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"not a JSON object but a {type(row).__name__}")
            stamp = row["timestamp"]
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
                raise TypeError(f"timestamp {stamp!r} is not a number of milliseconds")
            req = TraceRequest(stamp / 1000.0, _count(row, "input_length"), _count(row, "output_length"),
                               tuple(row["hash_ids"]))
            _check_request(req)
        # OverflowError: json reads 1e999 and 10**400; neither fits a float arrival or a count.
        # RecursionError: a line nested thousands deep ([[[[...]]]]) exceeds json's recursion.
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise ConfigError(f"{name} line {lineno}: not a Mooncake request ({exc})") from None
        expect = math.ceil(req.input_tokens / block_tokens)
        if len(req.blocks) != expect:
            raise ConfigError(f"{name} line {lineno}: {len(req.blocks)} hash ids for {req.input_tokens} tokens;"
                              f" with {block_tokens}-token blocks expect {expect} ({block_size_hint})")
        if stamp:
            nonzero_stamps += 1
            whole_stamps += float(stamp).is_integer()
        requests.append(req)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    # Time from the first request: the simulator's workers are idle from 0, and its
    # throughput is over the simulated span; an offset clock would skew both.
    t0 = requests[0].arrival_s if requests else 0.0
    if t0:
        requests = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in requests]
    requests, rekeyed, content_ids = _as_prefix_ids(requests)
    notes = []
    if rekeyed:
        notes.append(f"{name}: hash ids of block contents, not of prefixes ({content_ids:,} of them follow more "
                     f"than one parent): re-keyed {rekeyed:,} (parent, id) pairs to fresh ids, so that every hit "
                     "is a prefix hit")
    seconds_like = _seconds_like(len(requests), nonzero_stamps, whole_stamps,
                                 requests[-1].arrival_s if requests else 0.0)
    if seconds_like:
        notes.append(f"{name}: the timestamps look like seconds ({seconds_like}); the format's are milliseconds, "
                     "and they are read so: if they are seconds, multiply them by 1000")
    return Trace(tuple(requests), block_tokens, source, tuple(notes))


def _seconds_like(requests: int, nonzero: int, whole: int, span_s: float) -> str:
    """Why the timestamps look like seconds rather than the format's milliseconds ('' if not):
    as milliseconds, their mean gap is a load no conversation service has, and they are
    fractional (most of them: a few of a seconds export are whole by chance) or many."""
    # 0 (or one request): every request at one instant, an offline batch, not a clock in the
    # wrong unit. Fractional alone says nothing of the unit (float milliseconds from datetimes
    # are common); the gap decides.
    if requests < 2 or not 0 < span_s / (requests - 1) < SECONDS_SUSPECT_GAP_S:
        return ""
    fractional = nonzero - whole
    if nonzero and fractional >= SECONDS_SUSPECT_FRACTIONAL_SHARE * nonzero:
        form = "none of them a whole number" if not whole else f"{fractional:,} of {nonzero:,} fractional"
        return f"{form}; as milliseconds, {requests:,} requests over {span_s:g} s"
    if requests >= SECONDS_SUSPECT_REQUESTS:
        return f"{requests:,} requests within {span_s * 1000:g} ms"
    return ""


def _as_prefix_ids(requests: list[TraceRequest]) -> tuple[list[TraceRequest], int, int]:
    """The requests with hash ids that name prefixes: each ``(parent, id)`` pair is one block.

    An id keeps its value under the first parent it follows (in arrival order; the root's
    parent is ``None``); under any other parent it becomes a fresh id above every id of the
    trace. Every hit count in kvtier (the replay, the simulator's holders, the benches'
    reusable bound) takes a block as cached when its id is, which is a prefix hit only if an
    id has one parent: with ids of block contents, ``[3, 2]`` after ``[1, 2]`` would hit
    block 2 though its prefix ``[3]`` was never seen. Returns the requests (the same objects
    where nothing changed), how many pairs were re-keyed, and how many ids they involved.
    One dict lookup per block when nothing needs it."""
    parent_of: dict[int, int | None] = {}
    fresh: dict[tuple[int | None, int], int] = {}
    next_id: int | None = None
    first_parent = parent_of.setdefault
    out = []
    for req in requests:
        prev: int | None = None
        blocks: list[int] | None = None   # built from the request's first re-keyed block on
        for i, raw in enumerate(req.blocks):
            block = raw
            if first_parent(raw, prev) != prev:
                block = fresh.get((prev, raw))
                if block is None:
                    if next_id is None:
                        next_id = max(b for r in requests for b in r.blocks) + 1
                    block = fresh[(prev, raw)] = next_id
                    next_id += 1
                if blocks is None:
                    blocks = list(req.blocks[:i])
            if blocks is not None:
                blocks.append(block)
            prev = block
        out.append(req if blocks is None else dataclasses.replace(req, blocks=tuple(blocks)))
    return out, len(fresh), len({raw for _, raw in fresh})


def _count(row: dict, field: str) -> int:
    """A token count: an integer (``1000.0`` is one too); not ``true``, not ``1000.9`` truncated."""
    value = row[field]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} {value!r} is not a whole number of tokens")
    return value


def _check_request(req: TraceRequest) -> None:
    """Values the format allows but no request can have: a NaN arrival would leave the sort
    unordered; a prompt has a token; hash ids are integers in the format (the benches seed each
    block's tokens with one)."""
    if req.input_tokens <= 0:
        raise ValueError(f"input_length {req.input_tokens}: a prompt has at least one token")
    if not math.isfinite(req.arrival_s):
        raise ValueError(f"timestamp {req.arrival_s * 1000.0} is not a finite number")
    if req.output_tokens < 0:
        raise ValueError(f"output_length {req.output_tokens} is negative")
    for block in req.blocks:
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"hash id {block!r} is not an integer")


def load_trace(path: str | Path, block_tokens: int = 512, block_size_hint: str = BLOCK_SIZE_HINT) -> Trace:
    """Load a trace file; one with no request is an error (every figure of it would be 0).
    The trace's :attr:`Trace.notes` (ids re-keyed, timestamps that look like seconds) are
    printed on stderr, one line each: the figures stand, but the reader should know."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {path} not found; {TRACE_HINT}")
    # Bytes are decoded (and gunzipped) while the lines are iterated, so the whole parse is
    # inside the try: a bad byte on line 90,000 is reported as well as one on line 1.
    try:
        with path.open("rb") as raw:
            gzipped = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            fh = gzip.GzipFile(fileobj=raw) if gzipped else raw
            trace = parse_trace_lines(io.TextIOWrapper(fh, encoding="utf-8-sig"), block_tokens, str(path),
                                      block_size_hint)
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise ConfigError(f"trace {path}: not a UTF-8 JSONL (or gzipped JSONL) file ({exc})") from None
    if not trace.requests:
        raise ConfigError(f"trace {path} holds no request (an empty file, or only blank lines)")
    for note in trace.notes:
        print(f"kvtier: note: {note}", file=sys.stderr)
    return trace


def default_trace_path() -> Path | None:
    """The shared conversation trace: ``$KVTIER_TRACE`` when set (even to a file that is
    absent, so that a wrong setting is reported, not silently replaced), else looked for
    beside the working directory and the checkout."""
    override = os.environ.get(TRACE_ENV)
    if override:
        return Path(override).expanduser()
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        candidate = base.parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
        if candidate.is_file():
            return candidate
    return None
