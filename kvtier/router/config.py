"""``RouterConfig``: workers and pricing of ``kvtier route``, from a TOML file then flags.

Bandwidths and speeds are defaults a user overrides with what was measured on the
deployment: ``measured = [FILE, …]`` (``--measured FILE``) reads the JSON that
``kvtier bench storage --tier host --json`` (a worker's host DRAM tier: its ``get_gbps``)
and ``kvtier bench remote --json`` (the shared server: ``get_gbps``, or
``encrypted_get_gbps`` of an ``--encrypt`` run) print; explicit bandwidth settings win
over them. The router also measures each worker's prefill speed from its answers and
uses that for queueing.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from kvtier.core.units import parse_size
from kvtier.errors import ConfigError
from kvtier.policy.routing import ROUTE_NAMES
from kvtier.private_files import read_private_file, refuse_readable_secrets

log = logging.getLogger(__name__)

#: the form cap left unset (``max_form_body_bytes``): vLLM's 25 MiB audio file and 7 MiB for the
#: form's other fields and framing, lowered to fit the bounds on bodies held at once
DEFAULT_FORM_BODY_BYTES = 32 << 20

#: where ``kvtier route`` takes its CURVE secret from (a flag would show in ``ps``)
SECRETS_ENV = "KVTIER_ROUTER_EVENTS_SECRET"
#: settings that hold a secret: a config file with one must be this user's, mode 0600
SECRET_SETTINGS = ("shared_events_secret", "worker_api_key")


@dataclass
class WorkerSpec:
    url: str
    events: str | None = None     #: ZMQ endpoint of the worker's vLLM ``--kv-events-config``
    replay: str | None = None     #: its ``replay_endpoint``: catch up on connecting and after lost events

    @classmethod
    def parse(cls, text: str) -> "WorkerSpec":
        """``URL``, ``URL,events=ENDPOINT`` or ``URL,events=ENDPOINT,replay=ENDPOINT``."""
        url, *opts = [p.strip() for p in text.split(",")]
        found: dict[str, str] = {}
        for opt in opts:
            name, _, value = opt.partition("=")
            if name not in ("events", "replay") or not value:
                raise ConfigError(f"worker {text!r}: options are events=ENDPOINT and replay=ENDPOINT, got {opt!r}")
            found[name] = value
        if "replay" in found and "events" not in found:
            raise ConfigError(f"worker {text!r}: replay= needs events= (the replay fills the event stream's holes)")
        if not url.lower().startswith(("http://", "https://")):
            raise ConfigError(f"worker {text!r}: the URL must start with http:// or https://")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:   # a port out of range or not a number
            raise ConfigError(f"worker {text!r}: {exc}") from None
        if not parts.hostname or port == 0:
            raise ConfigError(f"worker {text!r}: the URL needs a host (and a port from 1 to 65535, if given)")
        beyond = beyond_base_url(url)
        if beyond is not None:
            raise ConfigError(f"worker {text!r}: {beyond}")
        unresolvable = host_error(url)
        if unresolvable is not None:
            raise ConfigError(f"worker {text!r}: {unresolvable}")
        for name, value in found.items():
            zmq_endpoint(value, f"worker {text!r}: {name}=")
        return cls(normal_url(url), found.get("events"), found.get("replay"))


#: the port a scheme's URL means when it names none: written out, it names the same worker
DEFAULT_PORTS = {"http": 80, "https": 443}


def normal_url(url: str) -> str:
    """``url`` as the router names a worker: scheme and host in lower case (as DNS and HTTP read
    them), the port as a number and left out where it is the scheme's default, no trailing slash,
    so that one worker given two ways is one name: ``HTTPS://LLM:443/`` and ``https://llm`` are
    ``https://llm`` (the explicit default port made two workers of one: audit s34 r4 D4). A
    ``ValueError`` for a URL ``urlsplit`` cannot read, or a port that is no number up to 65535."""
    parts = urlsplit(url)
    scheme, port = parts.scheme.lower(), parts.port
    host = _connected_host(parts.hostname or "")
    if ":" in host:   # an IPv6 address, bracketed as a URL writes it
        host = f"[{host}]"
    if port is not None and port != DEFAULT_PORTS.get(scheme):
        host += f":{port}"
    user, at, _ = parts.netloc.rpartition("@")   # (kept: such a URL is refused, never named another's)
    return f"{scheme}://{user}{at}{host}{parts.path.rstrip('/')}"


def _connected_host(host: str) -> str:
    """``host`` as the connection reads it, so that one worker written two ways is one name (audit
    s34 r9 D1): an IP address in its one text form (``0:0:0:0:0:0:0:1`` is ``::1``; an IPv6 zone kept
    as given), a name in its IDNA form (``bücher.example`` is ``xn--bcher-kva.example``, as yarl
    maps it for aiohttp). Left as given where neither applies."""
    address, percent, zone = host.partition("%")
    try:
        return ipaddress.ip_address(address).compressed + percent + zone
    except ValueError:
        pass
    if host.isascii():
        return host
    import yarl   # (as in host_error: yarl comes with aiohttp; the planner reads this module without it)

    try:
        return yarl.URL.build(scheme="http", host=host).raw_host or host
    except ValueError:   # UnicodeError included: the caller's checks refuse such a host
        return host


def beyond_base_url(url: str) -> str | None:
    """Why ``url`` is more than a worker's base URL (``scheme://host:port``), or None. The router
    appends its paths to it (``/health``, the client's ``/v1/...``): the OpenAI base URL
    ``http://host:8000/v1`` had every request sent to ``/v1/v1/...`` (404) and the worker ejected.
    And it shows the URL to every client (``X-Kvtier-Worker``, ``GET /health``, ``/metrics``):
    ``http://user:password@host`` showed the password (audit s34 a4 D5)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return ("a user or password in the URL would be shown to every client (X-Kvtier-Worker, /health, "
                "/metrics): give scheme://host:port, and the workers' --api-key as worker_api_key in the config "
                "file or $KVTIER_WORKER_API_KEY")
    if parts.path not in ("", "/") or "?" in url or "#" in url:
        return ("give the worker's base URL, scheme://host:port, with no path, query or fragment: the router adds "
                "the client's path (/v1/... after a path of /v1 is /v1/v1/...)")
    return None


def host_error(url: str) -> str | None:
    """Why no connection to ``url``'s host can even be tried, or None. Every host name is
    IDNA-encoded to be resolved (``socket.getaddrinfo``): an empty label or one over 63 characters
    raises ``UnicodeError`` there, a ``ValueError`` that aiohttp passes on as it is, not a
    ``ClientError``. Accepted, such a worker ended the router's health checks for good and had
    each request sent to it answered 400 (audit s33 a5 D5).

    The host is checked as aiohttp will use it: yarl first maps it by UTS-46 (IDNA 2008), then
    the resolver encodes that. Python's own IDNA-2003 codec on the raw host let ``ab⒈.example``
    pass (one label ``ab1.`` there; ``ab1..example``, an empty label, once yarl mapped it:
    audit s33 r5 D2)."""
    # (imported here: yarl comes with aiohttp, the router's; the planner reads this module without it)
    import yarl

    try:
        host = yarl.URL(url).raw_host
        if host:
            host.encode("idna")
    except ValueError as exc:   # UnicodeError included; yarl's own refusals (brackets left open, a soft hyphen)
        return f"its host cannot be resolved ({exc})"
    if not host:
        return "the URL has no host"
    return None


def zmq_endpoint(value: str, what: str) -> str:
    """``value`` if it is an endpoint the router can connect a ZMQ socket to (``tcp://HOST:PORT``
    or ``ipc://PATH``), else a :class:`ConfigError` naming ``what``: ZMQ itself raises only when
    the socket connects, in a background task, where a mistyped endpoint went unseen."""
    scheme, sep, rest = value.partition("://") if isinstance(value, str) else ("", "", "")
    if sep and scheme == "ipc" and rest:
        return value
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if host == "*":   # what a worker binds; the router connects, so it needs the worker's host
            raise ConfigError(f"{what}{value!r}: the router connects to this endpoint: give the worker's host "
                              "in place of *")
        if colon and host and port.isdigit() and 0 < int(port) < 65536:
            return value
    raise ConfigError(f"{what}{value!r} is not a ZMQ endpoint: use tcp://HOST:PORT or ipc:///PATH")


def replay_beside(events: str) -> str:
    """The replay endpoint kvtier's launchers give a worker beside its ipc event endpoint
    (``…/w1.events`` → ``…/w1.replay``)."""
    return events.rsplit(".events", 1)[0] + ".replay"


@dataclass
class RouterConfig:
    workers: list[WorkerSpec] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "tier-aware"
    model_path: str | None = None          #: local model folder: tokenizer + chat template (+ KV geometry)
    block_tokens: int = 32                 #: vLLM ``--block-size`` of the workers (the events' block size)
    kv_bytes_per_token: int | None = None  #: default: from the model's config.json
    host_read_bytes_per_s: float = 8e9     #: a worker's host DRAM → GPU (vLLM's CPU medium)
    host_latency_s: float = 0.0002
    shared_read_bytes_per_s: float = 1e9   #: the shared kvtier server → a worker
    shared_latency_s: float = 0.001
    shared_writes: bool = False            #: workers write what they compute through to a shared tier
    shared_events: str | None = None       #: the kvtier server's events endpoint
    shared_events_server_public: str | None = None
    shared_events_public: str | None = None
    #: the router's CURVE secret (the server admits its public key, usually for every tenant's
    #: events): from the environment (KVTIER_ROUTER_EVENTS_SECRET), ``shared_events_secret_file``
    #: or a 0600 config file, never a flag: argv is public
    shared_events_secret: str | None = None
    #: a file holding that secret (0600, this user's; beside the config file if relative)
    shared_events_secret_file: str | None = None
    measured: list[str] = field(default_factory=list)   #: bench JSON files: bandwidths measured on this deployment
    prefill_tokens_per_s: float = 2000.0   #: until measured per worker
    prefill_overhead_s: float = 0.005
    decode_block_s: float = 0.0005         #: decode pressure per active block until a worker's decode step is measured
    step_tokens: int = 2048                #: the workers' prefill step (vLLM --max-num-batched-tokens); 0: none
    #: predicted uncached tokens sent to a worker before its further requests wait in the router,
    #: soonest-finishing first (kvtier.router.admission); 0 (default): off, every request sent at
    #: once. Off by default: on the trace bench it helped the baseline's plain workers (p50 0.69x)
    #: but not the kvtier workers, whose connector loads then start only when a request is sent.
    admission_tokens: int = 0
    #: the most streamed requests the router holds for admission at once, every worker's together;
    #: one more that would have to wait is answered 429 (``rate_limit_error``) at once: each held
    #: request keeps its body and a handler, and a hung worker's queue would otherwise grow without
    #: end. 0: none is held (a worker's step full, the request is refused). Only with admission on.
    max_held: int = 1000
    #: the largest request body the router takes (bytes, or a size such as "16MiB" in the file);
    #: a larger one is answered 413 in the OpenAI error format before it is read whole. The
    #: default holds a prompt of 1 M token ids (about 7-8 MiB of JSON) twice over.
    max_body_bytes: int = 16 << 20
    #: the largest multipart form the router takes on vLLM's speech-to-text endpoints
    #: (``/v1/audio/transcriptions``, ``/v1/audio/translations``), whose audio file vLLM takes up
    #: to 25 MiB (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``, OpenAI's limit too): under
    #: ``max_body_bytes``, sized for JSON, a 20 MB file vLLM transcribes was refused 413 (audit
    #: s31 a4 D6). Counted in ``max_inflight_body_bytes`` as any body is. Set, those bounds on
    #: the bodies held at once must take it, as they take ``max_body_bytes``, and the default
    #: per-address bound is floored at it. Unset (None): :data:`DEFAULT_FORM_BODY_BYTES`, lowered
    #: to fit those bounds (:meth:`RouterConfig.check`, logged), so that a text-only deployment's
    #: small bounds still start (audit s31 r7 D5). Raise it with the workers' own cap.
    max_form_body_bytes: int | None = None
    #: the most leading tokens of a prompt the router tokenizes and keys to route it (a longer
    #: text is cut, its last partial block dropped): routing gains nothing past the longest
    #: prompt a worker takes, and a tokenized token costs the router ~400 bytes. The worker is
    #: still sent the whole body. Raise it to the workers' ``max_model_len`` if that is longer.
    max_route_tokens: int = 1 << 18
    #: the longest a client may take to send a request's body once its headers are in; past it,
    #: 408 and the connection closed (a client that stalls mid-body otherwise holds a socket
    #: and a handler for ever: ``header_timeout_s`` covers only a new connection's wait for its head)
    body_timeout_s: float = 60.0
    #: the longest a new connection may go without a whole request head, from when it connects;
    #: past it the connection is closed. aiohttp's keep-alive timer, an hour (75 s under
    #: ``run_app``), was all there was, and silent sockets piled up.
    header_timeout_s: float = 5.0
    #: the longest a kept-alive connection may stay idle between two requests (aiohttp's
    #: keep-alive timer); past it the connection is closed. Longer than clients keep pooled
    #: connections (aiohttp's 15 s, httpx's 5 s): a client that reuses one the router has just
    #: closed may fail its request (aiohttp's does not retry a POST). Idle connections are also
    #: the first closed when an address passes ``max_connections_per_peer``.
    keepalive_timeout_s: float = 75.0
    #: the most connections one client address may hold (kvtier.router.reads.PeerConnections):
    #: past it, that address's connection idle longest is closed, or the newcomer if every one
    #: has a request under way. 0 (default): a quarter of the router's open-file limit (which
    #: ``kvtier route`` raises to its hard limit at start). Behind a proxy every client shares
    #: the proxy's address: raise it there.
    max_connections_per_peer: int = 0
    #: the bytes of request bodies the router holds at once, every request's together (bytes, or
    #: a size such as "1GiB" in the file): counted as they arrive (never as a ``Content-Length``
    #: declares) and kept until the answer ends; a body whose next piece would pass it is answered
    #: 429 (``rate_limit_error``) and its connection closed. At least ``max_body_bytes`` and
    #: ``max_form_body_bytes``.
    max_inflight_body_bytes: int = 1 << 30
    #: the bytes of request bodies one client address may have begun and not finished sending
    #: (bytes, or a size such as "128MiB" in the file): sending most of many bodies and then
    #: stalling is the cheapest way to hold ``max_inflight_body_bytes``; past it, 429 as there.
    #: 0 (default): an eighth of ``max_inflight_body_bytes``, at least ``max_body_bytes``, and at
    #: least ``max_form_body_bytes`` where that is set (a value set must be at least the largest).
    #: Bodies wholly in do not count. Behind a proxy every client shares the proxy's address:
    #: raise it there.
    max_arriving_body_bytes_per_peer: int = 0
    temperature: float = 0.0
    index_capacity: int = 1 << 22
    #: a CPU copy without extra keys whose first blocks the router never saw stored (vLLM's offloading
    #: connector after a router restart or an event gap): "base" keyed as the base model's, "drop"
    #: left out (its salt or adapter is unknown), "auto" (default) base until the router has seen a
    #: salt, an adapter or content extras, then drop. Only routing predictions depend on it.
    unkeyed_cpu_events: str = "auto"
    health_interval_s: float = 2.0
    eject_after: int = 2
    connect_timeout_s: float = 5.0
    #: the longest a worker may stay silent: before a stream's first byte, or between two chunks
    #: of any answer (no cap on a whole answer: a long generation that keeps streaming is never
    #: cut; a non-streamed answer's first byte, which comes after its whole decode, is waited for
    #: while its worker passes its health checks and stays in the pool, and for this long after it
    #: fails them or leaves it, unless it was sent to a worker already ejected), and the longest a
    #: client may take none of its relayed answer (its connection dropped)
    request_timeout_s: float = 600.0
    #: how often the router reads the workers' ``/v1/models`` for LoRA adapters (0: never;
    #: then adapters are learnt from KV events only)
    models_refresh_s: float = 30.0
    #: a worker's ``/tokenize`` of a chat prompt with tools or documents (kvtier.router.app)
    render_timeout_s: float = 5.0
    max_attempts: int = 3
    #: after a client left before its worker's first byte, the abort is sent again this many
    #: seconds after it left: vLLM ignores an abort for an id it has not yet registered, and its
    #: API server, short of CPU beside a decoding engine, may register a request seconds after
    #: it arrived (router/abort.py). Empty: one abort only.
    abort_again_s: tuple[float, ...] = (1.0, 5.0)
    #: at shutdown (SIGTERM), how long answers under way may go on before each is ended (an
    #: error event in a stream, a 503 before the first byte) and aborted on its worker; under
    #: an orchestrator's grace period (Kubernetes: 30 s by default)
    drain_timeout_s: float = 25.0
    #: the workers' vLLM ``--api-key``, for the router's own calls (the LoRA refresh; renders,
    #: aborts and response lookups for a client that sent no credentials). From the
    #: environment (KVTIER_WORKER_API_KEY) or the config file, never a flag: argv is public.
    worker_api_key: str | None = None

    #: the bandwidths a measurement file can give
    _DEFAULT_BANDWIDTHS = ("host_read_bytes_per_s", "shared_read_bytes_per_s")

    def __post_init__(self) -> None:
        self._explicit: set[str] = set()    #: bandwidths the user set (file or flag): measurements do not override
        self._sources: dict[str, str] = {}  #: bandwidth → the measurement file it came from
        self._form_cap_defaulted = False    #: max_form_body_bytes was unset: check() sized it

    def set_explicitly(self, name: str, value) -> None:
        setattr(self, name, value)
        self._explicit.add(name)
        if name == "max_form_body_bytes":   # (set now, not sized by an earlier check())
            self._form_cap_defaulted = False

    def apply_measured(self) -> None:
        """Bandwidths from the ``measured`` bench files, except those the user set."""
        for path in self.measured:
            name, value = measured_bandwidth(path)
            if name not in self._explicit:
                setattr(self, name, value)
                self._sources[name] = str(path)

    def largest_body(self) -> tuple[int, str]:
        """The largest body the router takes, of any kind, and the setting that says so: a JSON
        body's ``max_body_bytes`` or an audio form's ``max_form_body_bytes``, whichever is larger."""
        form = DEFAULT_FORM_BODY_BYTES if self.max_form_body_bytes is None else self.max_form_body_bytes
        if form > self.max_body_bytes:
            return form, "max_form_body_bytes"
        return self.max_body_bytes, "max_body_bytes"

    def form_cap_set(self) -> bool:
        """``max_form_body_bytes`` was set (file, flag or argument), not sized by :meth:`check`."""
        return self.max_form_body_bytes is not None and not self._form_cap_defaulted

    def arriving_body_bytes_per_peer(self) -> int:
        """``max_arriving_body_bytes_per_peer``, its 0 read as an eighth of the bodies in flight
        (``max_inflight_body_bytes``), never less than ``max_body_bytes``, nor than a form cap set
        (:meth:`largest_body`: floored at ``max_body_bytes`` alone, every audio form over it was
        answered 429, a retryable status, on every retry, though it could never fit: audit s31 r3
        D2). A form cap left unset is sized under this bound instead (:meth:`_size_form_cap`): floored
        at its default, a text-only deployment's bound rose from 16 to 32 MiB (audit s31 r7 D5)."""
        floor = self.largest_body()[0] if self.form_cap_set() else self.max_body_bytes
        return self.max_arriving_body_bytes_per_peer or max(self.max_inflight_body_bytes // 8, floor)

    def read_bandwidths(self) -> dict[str, tuple[float, str]]:
        """``{"host": (bytes/s, source), "shared": …}``: what loads are priced with, and why."""
        out = {}
        for tier, name in (("host", "host_read_bytes_per_s"), ("shared", "shared_read_bytes_per_s")):
            value = getattr(self, name)
            source = self._sources.get(name) or ("setting" if name in self._explicit else "default")
            out[tier] = (value, source)
        return out

    #: numeric settings: (integer, > 0 rather than >= 0, what 0 means where it is allowed)
    _NUMBERS = {
        "block_tokens": (True, True, ""), "index_capacity": (True, True, ""), "max_attempts": (True, True, ""),
        "eject_after": (True, True, ""), "kv_bytes_per_token": (True, True, ""),
        "step_tokens": (True, False, " (0: no shared prefill steps)"),
        "admission_tokens": (True, False, " (0: send every request at once)"),
        "max_held": (True, False, " (0: hold no request)"),
        "max_body_bytes": (True, True, ""), "max_form_body_bytes": (True, True, ""),
        "max_route_tokens": (True, True, ""),
        "body_timeout_s": (False, True, ""), "header_timeout_s": (False, True, ""),
        "keepalive_timeout_s": (False, True, ""),
        "max_connections_per_peer": (True, False, " (0: a quarter of the open-file limit)"),
        "max_inflight_body_bytes": (True, True, ""),
        "max_arriving_body_bytes_per_peer": (True, False, " (0: an eighth of max_inflight_body_bytes)"),
        "host_read_bytes_per_s": (False, True, ""), "shared_read_bytes_per_s": (False, True, ""),
        "prefill_tokens_per_s": (False, True, ""), "health_interval_s": (False, True, ""),
        "connect_timeout_s": (False, True, ""), "request_timeout_s": (False, True, ""),
        "render_timeout_s": (False, True, ""),
        "host_latency_s": (False, False, ""), "shared_latency_s": (False, False, ""),
        "prefill_overhead_s": (False, False, ""), "decode_block_s": (False, False, ""),
        "temperature": (False, False, " (0: take the minimum)"),
        "models_refresh_s": (False, False, " (0: never)"),
        "drain_timeout_s": (False, False, " (0: end answers under way at once)"),
    }

    #: settings that hold text: True where it may be unset (None). A path may be a ``Path`` too.
    _TEXTS = {
        "host": False, "policy": False, "model_path": True, "shared_events": True,
        "shared_events_server_public": True, "shared_events_public": True, "shared_events_secret": True,
        "shared_events_secret_file": True, "worker_api_key": True, "unkeyed_cpu_events": False,
    }
    _PATHS = ("model_path", "shared_events_secret_file")

    def check_types(self) -> None:
        """A :class:`ConfigError` naming the first setting of the wrong type (numbers: :meth:`check`).
        Unchecked, a TOML value of another type crashed ``kvtier route`` with a traceback (``policy =
        []``) or was taken as it was: ``shared_writes = "no"``, a true string, had the router price
        the workers as writing through to the shared tier (audit s34 a4 D1)."""
        for name, optional in self._TEXTS.items():
            value = getattr(self, name)
            if not (isinstance(value, str) or (optional and value is None)
                    or (name in self._PATHS and isinstance(value, os.PathLike))):
                raise ConfigError(f"{name} must be a string{' (or unset)' if optional else ''}, got {value!r}")
        if type(self.shared_writes) is not bool:
            raise ConfigError(f"shared_writes must be true or false, got {self.shared_writes!r}")
        # a bare string is iterable too: measured = "host.json" would be read one character at a time
        if not isinstance(self.measured, list) or not all(isinstance(m, (str, os.PathLike)) for m in self.measured):
            raise ConfigError(f"measured must be a list of bench JSON files, e.g. measured = [\"host.json\"], "
                              f"got {self.measured!r}")
        if not isinstance(self.workers, list) or not all(isinstance(w, WorkerSpec) for w in self.workers):
            raise ConfigError(f"workers must be a list of WorkerSpec (in a config file: [[worker]] url = ...), "
                              f"got {self.workers!r}")
        for w in self.workers:
            if not isinstance(w.url, str) or not all(isinstance(e, str) or e is None for e in (w.events, w.replay)):
                raise ConfigError(f"worker {w!r}: its url, events and replay must be strings")

    def _check_workers(self) -> None:
        """At least one worker, and each URL once (:func:`normal_url`): given twice, one engine was
        two workers, routed twice its share, and a drain of its URL marked only the first, so a
        planner's drained worker kept being sent requests (audit s34 a4 D2)."""
        if not self.workers:
            raise ConfigError("no workers: give --worker URL (repeatable) or [[worker]] in the config file")
        seen: set[str] = set()
        for w in self.workers:
            try:
                url = normal_url(w.url)
            except ValueError as exc:
                raise ConfigError(f"worker {w.url!r}: {exc}") from None
            if url in seen:
                raise ConfigError(f"worker {w.url} is given twice (--worker, [[worker]]): give each worker once")
            seen.add(url)

    def check(self) -> "RouterConfig":
        self.check_types()
        self.apply_measured()
        self._check_workers()
        if self.policy not in ROUTE_NAMES:
            raise ConfigError(f"unknown --policy {self.policy!r}; use one of {sorted(ROUTE_NAMES)}")
        if self.unkeyed_cpu_events not in ("auto", "base", "drop"):
            raise ConfigError(f"unkeyed_cpu_events is auto, base or drop, got {self.unkeyed_cpu_events!r}")
        for name in ("max_body_bytes", "max_form_body_bytes", "max_inflight_body_bytes",
                     "max_arriving_body_bytes_per_peer"):
            if isinstance(getattr(self, name), str):   # "16MiB" (the file), or a flag's text
                setattr(self, name, parse_size(getattr(self, name), name))
        for name, (integer, positive, zero) in self._NUMBERS.items():
            value = getattr(self, name)
            if value is None and name in ("kv_bytes_per_token", "max_form_body_bytes"):
                continue   # (the first from the model's config.json; the second sized below)
            # NaN passes every comparison below and then every price compares false: refused by name
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
                    or not math.isfinite(value):
                raise ConfigError(f"{name} must be {'an integer' if integer else 'a finite number'}, got {value!r}")
            if value < 0 or (positive and value == 0):
                raise ConfigError(f"{name} must be {'> 0' if positive else '>= 0' + zero}, got {value}")
        self._size_form_cap()
        self._check_body_bounds()
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0-65535 (0: any free port), got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host must be an address to listen on, got {self.host!r}")
        if self.shared_events is not None:
            zmq_endpoint(self.shared_events, "shared_events ")
        if self.shared_events_secret_file:
            if self.shared_events_secret:
                raise ConfigError("shared_events_secret and shared_events_secret_file both set: give one")
            self.shared_events_secret = read_private_file(
                self.shared_events_secret_file, "shared_events_secret_file", f"give the secret as ${SECRETS_ENV}",
                why="it lets its holder subscribe to the server's events as this router",
            ).decode("ascii", "replace").strip()
            self.shared_events_secret_file = None   # read: check() runs again in Router()
        if self.shared_events_secret is not None and len(self.shared_events_secret) != 40:
            raise ConfigError("shared_events_secret: expected the 40-character z85 CURVE secret (`kvtier admin "
                              "new-events-keys`)")
        self.abort_again_s = seconds_list(self.abort_again_s, "abort_again_s")
        return self

    def _size_form_cap(self) -> None:
        """A form cap left unset: :data:`DEFAULT_FORM_BODY_BYTES`, lowered to the bodies held at once
        (``max_inflight_body_bytes``, one address's: :meth:`arriving_body_bytes_per_peer`), and
        logged if so. Refusing such configs refused text-only deployments' small bounds, which
        started before the form cap existed (audit s31 r7 D5); a form cap set is refused instead.
        Never under ``max_body_bytes``, which both bounds take: before the form cap existed it was
        the cap on forms too, and a deployment that had raised it to take larger audio files (64 MiB)
        had every form over 32 MiB refused 413 on upgrade (audit s32 a1 D4)."""
        if self.form_cap_set():
            return
        unset = self.max_form_body_bytes is None   # (else sized by an earlier check(): again, quietly)
        self.max_form_body_bytes = None
        sized = min(DEFAULT_FORM_BODY_BYTES, self.max_inflight_body_bytes, self.arriving_body_bytes_per_peer())
        cap = max(sized, self.max_body_bytes)
        if unset and cap < DEFAULT_FORM_BODY_BYTES:
            log.info("max_form_body_bytes (unset) is %d, under its default %d: the bounds on bodies held at "
                     "once take no larger audio form (set max_form_body_bytes, and those bounds, to take one)",
                     cap, DEFAULT_FORM_BODY_BYTES)
        self.max_form_body_bytes, self._form_cap_defaulted = cap, True

    def _check_body_bounds(self) -> None:
        """The bounds on the bodies held at once take the largest body taken (:meth:`largest_body`),
        or no body of that size is ever served: each is answered 429 on every retry."""
        largest, setting = self.largest_body()
        lower = " (or lower max_form_body_bytes, if no audio form is that large)" \
            if setting == "max_form_body_bytes" else ""
        if self.max_inflight_body_bytes < largest:
            raise ConfigError(f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must be at least "
                              f"{setting} ({largest}), or no body of that size is ever taken{lower}")
        if 0 < self.max_arriving_body_bytes_per_peer < largest:
            raise ConfigError(f"max_arriving_body_bytes_per_peer ({self.max_arriving_body_bytes_per_peer}) must be "
                              f"at least {setting} ({largest}), or no body of that size is ever taken (0: an eighth "
                              f"of max_inflight_body_bytes){lower}")

    @property
    def admission_cap(self) -> int:
        """Tokens a worker is sent before the router holds its requests (0: never holds)."""
        return self.admission_tokens

    @classmethod
    def from_file(cls, path: str | Path) -> "RouterConfig":
        """The settings of a TOML file; one that holds a secret (:data:`SECRET_SETTINGS`) must be this
        user's, mode 0600."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
                refuse_readable_secrets(f.fileno(), str(path), [k for k in SECRET_SETTINGS if data.get(k)],
                                        f"give them as ${SECRETS_ENV} / $KVTIER_WORKER_API_KEY, or the CURVE "
                                        f"secret as shared_events_secret_file (a 0600 file)")
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"router config {path}: {exc}") from None
        known = {f.name for f in fields(cls)} - {"workers"}   # (workers are [[worker]] tables)
        workers = data.pop("worker", [])
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"router config {path}: unknown settings {unknown}; known: {sorted(known)} "
                              f"(and [[worker]] url = ...)")
        config = cls(**data)
        try:   # (before the paths below are joined to the file's folder)
            config.check_types()
        except ConfigError as exc:
            raise ConfigError(f"router config {path}: {exc}") from None
        # measurement files named in the config file are found beside it, and so is the secret file
        config.measured = [str(Path(path).parent / m) for m in config.measured]
        if config.shared_events_secret_file:
            config.shared_events_secret_file = str(Path(path).parent / config.shared_events_secret_file)
        # bandwidths written in the file are the user's own: measurement files do not override them
        config._explicit.update(k for k in data if k in cls._DEFAULT_BANDWIDTHS)
        for w in workers:
            if not isinstance(w, dict) or "url" not in w or set(w) - {"url", "events", "replay"} \
                    or not all(isinstance(v, str) for v in w.values()):
                raise ConfigError(f"router config {path}: each [[worker]] has url and optional events and replay, "
                                  f"each a string, got {w!r}")
            config.workers.append(WorkerSpec.parse(w["url"] + "".join(f",{k}={w[k]}" for k in ("events", "replay")
                                                                      if w.get(k))))
        return config


def seconds_list(value, name: str) -> tuple[float, ...]:
    """``value`` as a tuple of finite seconds >= 0, else a :class:`ConfigError` naming ``name``
    (a bare number or a string, which TOML allows, failed only when first used: in the path
    that aborts a departed client's request)."""
    if isinstance(value, (list, tuple)) and all(not isinstance(x, bool) and isinstance(x, (int, float))
                                                and math.isfinite(x) and x >= 0 for x in value):
        return tuple(float(x) for x in value)
    raise ConfigError(f"{name} must be a list of seconds >= 0 (e.g. [1.0, 5.0]; [] for none), got {value!r}")


def measured_bandwidth(path: str | Path) -> tuple[str, float]:
    """``(RouterConfig field, bytes/s)`` from a ``kvtier bench storage --tier host --json`` or
    ``kvtier bench remote --json`` output file; a clear error for anything else."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"measured bandwidths {path}: {exc}") from None
    data = None
    for candidate in (text, *reversed(text.strip().splitlines())):   # the object, or its last JSON line
        try:
            data = json.loads(candidate)
            break
        except ValueError:
            continue
    if not isinstance(data, dict):
        raise ConfigError(f"measured bandwidths {path}: not the JSON of `kvtier bench storage --json` "
                          "or `kvtier bench remote --json`")
    if data.get("bench") == "remote":
        key, name = ("encrypted_get_gbps" if data.get("encrypted_get_gbps") else "get_gbps"), "shared_read_bytes_per_s"
    elif data.get("tier") == "host":
        key, name = "get_gbps", "host_read_bytes_per_s"
    else:
        raise ConfigError(f"measured bandwidths {path}: expected the output of `kvtier bench storage --tier host "
                          f"--json` (a worker's host tier) or `kvtier bench remote --json` (the shared tier); "
                          f"got tier={data.get('tier')!r} bench={data.get('bench')!r} (the router prices no disk tier)")
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"measured bandwidths {path}: {key} must be a positive number, got {value!r}")
    return name, float(value) * 1e9
