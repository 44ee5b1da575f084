"""``kvtier top``: a live terminal view of a deployment, from its metrics endpoints alone.

Scrapes ``/metrics`` of the kvtier server (with the admin token: per-tenant series), the
router, and the workers (vLLM's own ``/metrics``), and a planner's JSON status file if
given; redraws every ``--interval`` seconds (rich ``Live``), or renders one frame with
``--once``. The server's hit rates are from counter deltas between frames (counters that went
down, a restarted server's, are read from their new totals, as Prometheus reads a reset); the
first frame shows them since start. A worker's "routed" is the router's total since it started,
its "KV use" its fullest engine's. An endpoint that does not answer is shown as down, never a
crash.
"""

from __future__ import annotations

import http.client
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import NamedTuple

from kvtier.cli.admin import add_token_options, given_token
from kvtier.core.units import finite_float

#: the longest wait a flag may ask for, ``--interval`` here and ``plan live``'s (a day): ``time.sleep``
#: overflows a C ``time_t`` far below ``finite_float``'s bound (``--interval 1e300`` crashed after the
#: first frame)
MAX_WAIT_S = 86400.0

#: vLLM's KV cache fill gauge, under its current name and its older one
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def register(subparsers) -> None:
    parser = subparsers.add_parser("top", help="live view of a deployment from its /metrics endpoints")
    parser.add_argument("--server", default=None, help="kvtier serve metrics address (host:port or URL)")
    parser.add_argument("--router", default=None, help="kvtier route address (host:port or URL)")
    parser.add_argument("--worker", action="append", default=[], help="a worker's vLLM address (repeatable)")
    # (a token shows the per-tenant series)
    add_token_options(parser, "server's metrics token (or the admin token, on a loopback metrics address)",
                      "$KVTIER_METRICS_TOKEN, then $KVTIER_ADMIN_TOKEN")
    parser.add_argument("--planner-status", default=None, help="JSON status file written by a planner")
    parser.add_argument("--planner", default=None, help="kvtier plan live --metrics-port address (host:port or URL)")
    parser.add_argument("--interval", type=finite_float, default=1.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="render one frame to stdout and exit")
    parser.set_defaults(func=run)


class Samples(NamedTuple):
    up: bool
    values: dict          # (name, frozenset(labels.items())) -> value
    error: str = ""

    def get(self, name: str, **labels) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= ls)

    def fullest(self, names) -> float | None:
        """The largest finite sample of any of ``names``, or None without one: a gauge of one
        series per engine (data parallel) read as its fullest engine, never their sum; a NaN
        (a 0/0 while an engine restarts) is no reading."""
        finite = [v for (n, _), v in self.values.items() if n in names and math.isfinite(v)]
        return max(finite) if finite else None

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (n, ls), v in self.values.items():
            if n == name:
                key = dict(ls).get(label)
                if key is not None:
                    out[key] += v
        return dict(out)


def _url(address: str) -> str:
    base = address if "://" in address else f"http://{address}"
    return base.rstrip("/") + ("" if base.rstrip("/").endswith("/metrics") else "/metrics")


#: the most bytes of one ``/metrics`` answer read: a vLLM worker's is tens of KiB, a kvtier
#: server's with many tenants a few MiB; anything larger is refused (down), not held in memory
MAX_METRICS_BYTES = 16 << 20


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is the answer, never followed: urllib copies every header of a request into the one it
    redirects, to whatever host ``Location`` names, and a scrape with a token must not hand it there."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None   # urllib then raises the 3xx as an HTTPError


#: what a request that carries a token is sent through (redirects not followed)
_TOKEN_OPENER = urllib.request.build_opener(_NoRedirect)


def scrape(address: str | None, token: str | None = None, timeout_s: float = 2.0) -> Samples:
    """The samples at ``address``'s ``/metrics``, or a down result with its reason; never raises.

    ``timeout_s`` bounds the whole body, not each socket read: a peer that drips its answer (an
    overloaded exporter, a broken proxy) is down once the time is spent, so one slow endpoint
    cannot hold ``kvtier top`` or the live planner's loop. (Connecting and the headers are bounded
    per read by urllib, each read ``timeout_s``.) An answer over :data:`MAX_METRICS_BYTES` is down.
    With a ``token`` a redirect is not followed (down, naming where it pointed): the token goes to
    ``address`` only."""
    if not address:
        return Samples(False, {}, "not given")
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    values = {}
    try:   # the parse too: a 200 that is not the text format (an HTML error page) is down, not a crash
        # the request as well: a malformed address (``http://[::1``) raises ValueError here
        request = urllib.request.Request(_url(address), headers={"Authorization": f"Bearer {token}"} if token else {})
        with (_TOKEN_OPENER.open if token else urllib.request.urlopen)(request, timeout=timeout_s) as response:
            body = _read_bounded(response, deadline)
        if isinstance(body, str):
            return Samples(False, {}, body)
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                values[(s.name, frozenset(s.labels.items()))] = s.value
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            return Samples(False, {}, f"redirected ({exc.code}) to {exc.headers.get('Location')!r}: not followed "
                                      f"with the token; give that address itself")
        return Samples(False, {}, str(exc))
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        return Samples(False, {}, str(exc) or type(exc).__name__)
    return Samples(True, values)


def _read_bounded(response, deadline: float) -> bytes | str:
    """The body of ``response``, or why not (a str): larger than :data:`MAX_METRICS_BYTES`, or not
    all there by ``deadline`` (monotonic)."""
    length = response.headers.get("Content-Length")
    if length and length.strip().isdigit() and int(length) > MAX_METRICS_BYTES:
        return f"answer of {int(length)} bytes, over the {MAX_METRICS_BYTES >> 20} MiB limit"
    # urllib keeps the socket's timeout per read; it is set to what is left of the deadline before
    # each read, so no read waits past it (private attributes: without them, each read waits at
    # most the original timeout and the deadline is checked between reads)
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    chunks, n = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "answer not complete within the timeout"
        if sock is not None:
            sock.settimeout(left)
        chunk = response.read1(65536)
        if not chunk:
            if getattr(response, "length", None):   # bytes of its Content-Length never came
                raise http.client.IncompleteRead(b"".join(chunks), response.length)
            return b"".join(chunks)
        n += len(chunk)
        if n > MAX_METRICS_BYTES:
            return f"answer over the {MAX_METRICS_BYTES >> 20} MiB limit"
        chunks.append(chunk)


class TenantRow(NamedTuple):
    """One tenant's figures: payload held, and the pool bytes its quota is charged (footprints: a
    64 B block takes a page), which is what the quota is judged against."""

    tenant: str
    bytes: float
    blocks: float
    charged: float | None       # None: a server that exports no kvtier_tenant_charged_bytes
    quota: float | None         # None: no quota

    def of_quota(self) -> float | None:
        """Charged / quota, or None where either is unknown."""
        return self.charged / self.quota if self.charged is not None and self.quota else None


class Frame(NamedTuple):
    """The figures one frame shows (kept apart from drawing so tests can check them)."""

    tiers: list[tuple[str, float, float]]           # name, used bytes, capacity bytes
    server_hit_rate: dict[str, float | None]        # op -> hits / (hits + misses)
    stored_blocks: float
    tenants: list[TenantRow]
    workers: list[dict]
    planner: dict | None
    down: list[str]


def _ratio(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses > 0 else None


def _hit_rate(server: Samples, prev_server: Samples | None, op: str) -> float | None:
    """``op``'s hit rate since ``prev_server`` (the previous frame's scrape), else since the server
    started. A counter that went down means the server restarted between the frames: as
    Prometheus reads a reset, both counters then count from 0, and their totals are the frame's
    (a delta across the restart showed -33 % or 133 %)."""
    counts = [server.get(name, op=op) for name in ("kvtier_hits_total", "kvtier_misses_total")]
    if prev_server is not None and prev_server.up:
        before = [prev_server.get(name, op=op) for name in ("kvtier_hits_total", "kvtier_misses_total")]
        if all(now >= then for now, then in zip(counts, before)):
            counts = [now - then for now, then in zip(counts, before)]
    return _ratio(*counts)


def build_frame(server: Samples, router: Samples, workers: dict[str, Samples], planner: dict | None,
                prev_server: Samples | None = None) -> Frame:
    used, cap = server.by("kvtier_tier_used_bytes", "tier"), server.by("kvtier_tier_capacity_bytes", "tier")
    tiers = [(name, used[name], cap.get(name, 0.0)) for name in used]
    hit_rate = {op: _hit_rate(server, prev_server, op) for op in ("get", "lookup")}
    tenants = _tenant_rows(server)
    routed, healthy = router.by("kvtier_router_requests_total", "worker"), router.by("kvtier_router_worker_healthy",
                                                                                      "worker")
    rows = []
    for name in sorted(set(routed) | set(healthy) | set(workers)):
        w = workers.get(name)
        rows.append({"worker": name, "healthy": healthy.get(name), "routed": routed.get(name, 0.0),
                     "running": w.get("vllm:num_requests_running") if w and w.up else None,
                     "waiting": w.get("vllm:num_requests_waiting") if w and w.up else None,
                     # the fullest engine, as the planner reads it (observe.fleet_load)
                     "kv_usage": w.fullest(KV_USAGE_METRICS) if w and w.up else None})
    down = [label for label, s in (("server", server), ("router", router)) if not s.up and s.error != "not given"]
    down += [name for name, s in workers.items() if not s.up]
    return Frame(tiers, hit_rate, server.get("kvtier_stored_blocks"), tenants, rows, planner, down)


def _tenant_rows(server: Samples) -> list[TenantRow]:
    """Per tenant (per-tenant series: a scrape with a token), the most payload first."""
    t_bytes, t_blocks = server.by("kvtier_tenant_used_bytes", "tenant"), server.by("kvtier_tenant_blocks", "tenant")
    charged = server.by("kvtier_tenant_charged_bytes", "tenant")
    quota = server.by("kvtier_tenant_quota_bytes", "tenant")
    rows = [TenantRow(t, t_bytes.get(t, 0.0), t_blocks.get(t, 0.0), charged.get(t), quota.get(t))
            for t in t_bytes.keys() | charged.keys()]
    return sorted(rows, key=lambda row: (-row.bytes, row.tenant))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(value: float) -> int | None:
    """A gauge as a whole count; None for NaN or an infinity (the text format allows them)."""
    return int(value) if math.isfinite(value) else None


def render(frame: Frame):
    """The frame as rich renderables. Every name or label that comes from an endpoint (tiers,
    tenants, workers, the planner's action and reason) is a ``Text``, never markup: an IPv6
    worker's ``[fd00::1]`` would be taken for a style tag, and a ``[/x]`` in a label raise."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    tiers = Table(title="kvtier server: tiers", expand=False)
    for col in ("tier", "used", "capacity", "fill"):
        tiers.add_column(col, justify="right" if col != "tier" else "left")
    for name, used, cap in frame.tiers:
        tiers.add_row(Text(name), _bytes(used), _bytes(cap), f"{used / cap:.1%}" if cap else "-")
    hits = " · ".join(f"{op} hit rate {'-' if r is None else f'{r:.1%}'}" for op, r in frame.server_hit_rate.items())

    parts = [tiers, Text(f"server: {hits} · {frame.stored_blocks:.0f} blocks stored", no_wrap=True)]
    if frame.tenants:
        parts.append(_tenant_table(frame.tenants))
    if frame.workers:
        w = Table(title="workers")
        for col in ("worker", "healthy", "routed", "running", "waiting", "KV use"):
            w.add_column(col)
        for row in frame.workers:
            w.add_row(Text(row["worker"]), "-" if row["healthy"] is None else ("yes" if row["healthy"] else "no"),
                      f"{row['routed']:.0f}", *("-" if row[k] is None else f"{row[k]:.0f}" for k in ("running", "waiting")),
                      "-" if row["kv_usage"] is None else f"{row['kv_usage']:.0%}")
        parts.append(w)
    if frame.planner:
        p = Table(title="planner")
        for col in ("pool", "action", "current → target", "reason"):
            p.add_column(col)
        for pool in ("prefill", "decode"):
            d = frame.planner.get(pool)
            d = d if isinstance(d, dict) else {}  # a status file of another shape: shown empty
            shown = lambda v: "-" if v is None else str(v)  # noqa: E731  (None: a NaN or infinite gauge)
            p.add_row(pool, Text(shown(d.get("action"))),
                      Text(f"{shown(d.get('current'))} → {shown(d.get('target'))}"), Text(str(d.get("reason", ""))))
        parts.append(p)
    if frame.down:
        parts.append(Text("down: " + ", ".join(frame.down), style="bold red"))   # a Text: no markup
    return Group(*parts)


def _tenant_table(rows: list[TenantRow]):
    """Payload bytes and blocks, and beside the quota what it is charged: payload alone reads a
    tenant at its quota (evicting its own blocks at every put) as nearly empty when its blocks are
    small."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="tenants")
    for col in ("tenant", "bytes", "blocks", "charged", "quota", "of quota"):
        t.add_column(col)
    for row in rows:
        share = row.of_quota()
        t.add_row(Text(row.tenant), _bytes(row.bytes), f"{row.blocks:.0f}",
                  "-" if row.charged is None else _bytes(row.charged), "-" if not row.quota else _bytes(row.quota),
                  "-" if share is None else f"{share:.1%}")
    return t


def planner_from_metrics(samples: Samples) -> dict | None:
    """The planner's last decision as its status file has it, from its ``/metrics`` alone."""
    if not samples.up:
        return None
    out: dict = {"forecast_rate": samples.get("kvtier_planner_forecast_request_rate"),
                 "sizing_rate": samples.get("kvtier_planner_sizing_request_rate"),
                 "hit_rate": samples.get("kvtier_planner_hit_rate")}
    for (name, labels), value in samples.values.items():
        if name == "kvtier_planner_last_decision_info" and value:
            ls = dict(labels)
            pool = ls.get("pool", "")
            out[pool] = {"action": ls.get("action"), "reason": ls.get("reason", ""),
                         "current": _count(samples.get("kvtier_planner_workers", pool=pool)),
                         "target": _count(samples.get("kvtier_planner_target_workers", pool=pool))}
    return out


def _planner_status(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        with open(path) as fh:
            status = json.load(fh)
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None  # not a planner's status: not shown


def run(args) -> int:
    from kvtier.errors import ConfigError

    try:
        token = given_token(args, "kvtier top", ("KVTIER_METRICS_TOKEN", "KVTIER_ADMIN_TOKEN"))
    except ConfigError as exc:
        print(f"kvtier top: {exc}", file=sys.stderr)
        return 2
    if not (args.server or args.router or args.worker or args.planner):
        print("kvtier top: give at least one of --server, --router, --worker, --planner", file=sys.stderr)
        return 2
    if not 0 < args.interval <= MAX_WAIT_S:
        print(f"kvtier top: --interval must be > 0 and at most {MAX_WAIT_S:g} seconds (a day), "
              f"got {args.interval:g}", file=sys.stderr)
        return 2

    for flag, address in [("--server", args.server), ("--router", args.router), ("--planner", args.planner),
                          *(("--worker", w) for w in args.worker)]:
        if address and (problem := _bad_address(address)):
            print(f"kvtier top: {flag} {address!r}: {problem}", file=sys.stderr)
            return 2
    from concurrent.futures import ThreadPoolExecutor

    # every endpoint at once: a slow one costs a frame its timeout once, not once per endpoint after it
    pool = ThreadPoolExecutor(max_workers=min(16, 3 + len(args.worker)), thread_name_prefix="kvtier-top")

    def sample(prev_server=None):
        server = pool.submit(scrape, args.server, token)
        router = pool.submit(scrape, args.router)
        workers = {_worker_key(w): pool.submit(scrape, w) for w in args.worker}
        planner_samples = pool.submit(scrape, args.planner) if args.planner else None
        planner = _planner_status(args.planner_status) or (planner_from_metrics(planner_samples.result())
                                                           if planner_samples else None)
        frame = build_frame(server.result(), router.result(), {k: f.result() for k, f in workers.items()},
                            planner, prev_server=prev_server)
        return frame, server.result()

    try:
        return _show(args, sample)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _worker_key(address: str) -> str:
    """A ``--worker`` address as the router labels that worker (:func:`normal_url`: lower case, no
    default port, no trailing slash), so that one worker is one row: the spelling given
    (``http://GPU-Node:8000``) made a second row beside the router's. An address ``normal_url``
    cannot read (a port out of range) is no router's worker: kept as given, its row shows it down."""
    from kvtier.router.config import normal_url

    url = (address if "://" in address else f"http://{address}").rstrip("/")
    try:
        return normal_url(url)
    except ValueError:
        return url


def _bad_address(address: str) -> str | None:
    """Why ``address`` cannot be a URL at all (an unclosed ``[``), or None. A port out of range or
    an unknown scheme is left to the scrape: that endpoint is shown down with its reason."""
    try:
        urllib.parse.urlsplit(_url(address))
    except ValueError as exc:
        return str(exc)
    return None


def _show(args, sample) -> int:
    from rich.console import Console
    from rich.live import Live

    if args.once:
        frame, _ = sample()
        Console(file=sys.stdout, width=160).print(render(frame))
        return 0
    frame, prev = sample()
    try:
        with Live(render(frame), refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                frame, prev = sample(prev)
                live.update(render(frame))
    except KeyboardInterrupt:
        return 0
