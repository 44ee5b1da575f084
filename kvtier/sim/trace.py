"""Request traces in the Mooncake format (FAST '25): one JSON object a line.

``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens),
``hash_ids``: one id per ``block_tokens``-token block of the prompt; equal ids mean an
equal prefix up to and including that block, so a hash id *is* a block identity and
the simulator needs no token text.

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

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def block_token_counts(self, request: TraceRequest) -> list[int]:
        """Tokens in each block of ``request``: full blocks, then the remainder."""
        n, b = request.input_tokens, self.block_tokens
        return [min(b, n - i * b) for i in range(len(request.blocks))]

    def head(self, count: int) -> "Trace":
        return Trace(self.requests[:count], self.block_tokens, self.source)


def parse_trace_lines(lines, block_tokens: int = 512, source: str = "") -> Trace:
    """Parse Mooncake-format lines; raise :class:`ConfigError` naming the line that is wrong."""
    requests = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(row["timestamp"] / 1000.0, _count(row, "input_length"), _count(row, "output_length"),
                               tuple(row["hash_ids"]))
            _check_request(req)
        # OverflowError: json reads 1e999 and 10**400; neither fits a float arrival or a count
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise ConfigError(f"{source or 'trace'} line {lineno}: not a Mooncake request ({exc})") from None
        if req.input_tokens <= 0 or len(req.blocks) != math.ceil(req.input_tokens / block_tokens):
            raise ConfigError(
                f"{source or 'trace'} line {lineno}: {len(req.blocks)} hash ids for {req.input_tokens} tokens;"
                f" with {block_tokens}-token blocks expect {math.ceil(req.input_tokens / block_tokens)}"
                " (is --block-tokens right?)"
            )
        requests.append(req)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    # Time from the first request: the simulator's workers are idle from 0, and its
    # throughput is over the simulated span; an offset clock would skew both.
    t0 = requests[0].arrival_s if requests else 0.0
    if t0:
        requests = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in requests]
    return Trace(tuple(requests), block_tokens, source)


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
    unordered; hash ids are integers in the format (the benches seed each block's tokens with
    one), distinct within a request (each names a different prefix)."""
    if not math.isfinite(req.arrival_s):
        raise ValueError(f"timestamp {req.arrival_s * 1000.0} is not a finite number")
    if req.output_tokens < 0:
        raise ValueError(f"output_length {req.output_tokens} is negative")
    for block in req.blocks:
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"hash id {block!r} is not an integer")
    if len(set(req.blocks)) != len(req.blocks):
        # A hash id names the prefix up to its block, so it cannot come twice in one prompt;
        # per-block content hashes would let one cached block serve every repeat of it.
        seen: set[int] = set()
        repeated = next(b for b in req.blocks if b in seen or seen.add(b))
        raise ValueError(f"hash id {repeated} repeats within the request (hash ids name prefixes, "
                         "not block contents: each block of a prompt has its own)")


def load_trace(path: str | Path, block_tokens: int = 512) -> Trace:
    """Load a trace file; one with no request is an error (every figure of it would be 0)."""
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
            trace = parse_trace_lines(io.TextIOWrapper(fh, encoding="utf-8-sig"), block_tokens, str(path))
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise ConfigError(f"trace {path}: not a UTF-8 JSONL (or gzipped JSONL) file ({exc})") from None
    if not trace.requests:
        raise ConfigError(f"trace {path} holds no request (an empty file, or only blank lines)")
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
