"""Server configuration: a TOML file, then ``KVTIER_SERVE_*`` environment variables, then flags.

Later sources override earlier ones field by field. Every error names the field,
the source and the fix. Example file (sizes take KiB/MiB/GiB/TiB, powers of 1024, or KB/MB/GB/TB, powers of 1000;
a bare "512M" is refused as ambiguous: see kvtier/core/units.py); every [server] key is shown, and
``tests/docs/test_server_config_example.py`` loads it as written, placeholders filled::

    [server]
    listen = ["tcp://127.0.0.1:7070", "unix:///run/kvtier/kvtier.sock"]   # tcp:// beyond loopback is
                               # refused unless insecure_plaintext = true: use tls:// (tls_cert, tls_key)
    tls_cert = "/etc/kvtier/tls.crt"   # PEM chain and key, for tls:// listeners (both or neither)
    tls_key = "/etc/kvtier/tls.key"
    insecure_plaintext = false # true: accept tcp:// (cleartext tokens and blocks) beyond loopback
    capacity = "8GiB"          # host DRAM pool
    max_block = "32MiB"        # largest block accepted (not what each block costs: blocks take whole
                               # pages of their own size); end-to-end sealed blocks need room for the
                               # seal: kvtier.crypto.aead.sealed_stream_nbytes(largest plaintext block)
    max_connections = 1024     # logged-in connections, at most max_connections_per_tenant
    max_connections_per_tenant = 512   # per tenant (leave it out for half of max_connections)
    max_unauthenticated = 64   # connections not yet logged in, in all ...
    max_connections_per_peer = 32      # ... and per address (the oldest silent one makes room)
    hello_timeout_s = 5        # a connection must log in within this
    idle_timeout_s = 300       # close a connection idle this long
    frame_timeout_s = 30       # close a connection whose frame takes this long
    login_failure_burst = 10   # failed logins an address may make at once ...
    login_failure_rate_per_s = 1.0   # ... and per second after that
    disk_dir = "/mnt/nvme/kvtier"   # optional spill tier
    disk_capacity = "500GiB"
    mooncake_master = "10.0.0.5:50051"   # optional: spill below that to a Mooncake Store fleet
    mooncake_metadata = "http://10.0.0.5:8080/metadata"   # its metadata server (default P2PHANDSHAKE)
    mooncake_secret_file = "/etc/kvtier/mooncake.secret"  # 0600, >= 16 random bytes (keys names and tags)
    mooncake_hostname = "10.0.0.7"  # the address the fleet's holders reach this server at (default 127.0.0.1)
    mooncake_tenant = "kvtier-serve"   # the fleet tenant the blocks are named under (the default): servers
                                       # that share the fleet's blocks use the same one and the same secret
    mooncake_replicas = 1
    mooncake_timeout_s = 2.0   # deadline of each fleet call (longer for a large transfer): past it, a miss
    sweep_interval_s = 1.0     # how often blocks past their TTL are removed (at most every 0.05 s)
    fleet_audit_interval_s = 30   # with mooncake_master: how often at most the sweep begins asking the fleet
                                  # about every block indexed there, dropping those it evicted on its own
    shutdown_flush_timeout_s = 30   # SIGTERM/SIGINT: copy DRAM-only blocks to disk_dir for at most this long
    state_dir = "/var/lib/kvtier"   # runtime admin changes (quotas, TTLs) kept here (default: disk_dir);
                                    # they win over this file's values after a restart
    encrypt_at_rest = true          # seal spilled blocks per tenant (needs a master key:
    master_key_file = "/etc/kvtier/master.key"   # this file, mode 0600, or $KVTIER_MASTER_KEY)
    keystore_dir = "/var/lib/kvtier/keys"        # wrapped per-tenant keys (default: <disk_dir>/keys)
    metrics = "127.0.0.1:9400"      # Prometheus /metrics and /healthz: plain HTTP (per-tenant series only
                                    # with a metrics token, or the admin token on a loopback address)
    metrics_token_sha256 = ["<hash of a read-only scrape token>"]   # "Authorization: Bearer <metrics token>"
    metrics_require_token = false   # true: /metrics answers only a scrape with such a token
    events = "tcp://127.0.0.1:5557" # KV events for routers (CURVE-authenticated; or ipc:///path, 0600)
    events_curve_secret = "<z85>"   # from `kvtier admin new-events-keys` (or $KVTIER_SERVE_EVENTS_CURVE_SECRET)
    events_name_key = "<hex>"       # the secret subscribers name blocks with (same command); a file
                                    # holding either secret must be 0600 and this user's
    events_subscribers = ["<z85 public key>=*", "<z85 public key>=acme"]   # key=scope: '*' or a tenant
    events_buffer = 10000           # events (not messages) kept for replay, per scope ('*' and each tenant's)
    audit_log = "/var/log/kvtier/audit.jsonl"

    [admin]
    token_sha256 = ["<64 hex digits from `kvtier admin hash-token`>"]

    [[tenant]]
    name = "acme"
    token_sha256 = ["..."]
    quota = "2GiB"
    ttl_s = 86400
    namespace_ttl_s = { scratch = 600 }
    read_shared = ["system-prompts"]

    [[shared]]
    name = "system-prompts"   # clients address it as namespace "shared/system-prompts"
    writers = ["acme"]        # tenants that may publish into it (each a [[tenant]] above)
    ttl_s = 0                 # 0: no expiry
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvtier.core.namespace import NAME_RULE, SHARED_PREFIX, check_namespace  # the client's rule too
from kvtier.core.units import parse_size  # the one size parser; imported from here too
from kvtier.errors import ConfigError
from kvtier.store.config import MAX_SECONDS
from kvtier.private_files import refuse_readable_secrets

ENV_PREFIX = "KVTIER_SERVE_"
# Always .fullmatch: with .match, "$" also matches before a trailing newline ("acme\n").
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    token_sha256: tuple[str, ...]
    quota_bytes: int | None = None  #: None: no quota
    ttl_s: float | None = None  #: None: no expiry
    namespace_ttl_s: Mapping[str, float] = field(default_factory=dict)
    read_shared: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedConfig:
    name: str
    writers: tuple[str, ...] = ()
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: tuple[str, ...] = ("tcp://127.0.0.1:7070",)
    capacity_bytes: int = 1 << 30
    max_block_bytes: int = 32 << 20
    disk_dir: str | None = None
    disk_capacity_bytes: int = 0
    #: a Mooncake Store fleet below DRAM and disk (kvtier/tiers/mooncake.py); None: none
    mooncake_master: str | None = None
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_hostname: str = "127.0.0.1"  # the address the fleet's holders reach this server at
    mooncake_replicas: int = 1
    mooncake_timeout_s: float = 2.0
    mooncake_secret_file: str | None = None  # default: derived from the master key (encrypt_at_rest)
    mooncake_tenant: str = "kvtier-serve"  # the fleet tenant this server's blocks are named under
    encrypt_at_rest: bool = False
    master_key_file: str | None = None
    keystore_dir: str | None = None
    idle_timeout_s: float = 300.0
    frame_timeout_s: float = 30.0
    max_connections: int = 1024
    max_unauthenticated: int = 64
    max_connections_per_peer: int = 32
    #: logged-in connections one tenant may hold. The default, 0, stands for half of ``max_connections``
    #: (at least 1), so that one tenant's token (or a leak of it) cannot take every slot and lock the
    #: other tenants out; a file, variable or flag gets it by leaving the key out (a written 0 is refused)
    max_connections_per_tenant: int = 0
    hello_timeout_s: float = 5.0
    login_failure_burst: int = 10  # failed logins a TCP peer may make at once …
    login_failure_rate_per_s: float = 1.0  # … and per second after that
    metrics: str | None = None
    #: read-only scrape tokens (hashes): they unlock the per-tenant series of /metrics and nothing else.
    #: The admin token does too, but only on a loopback metrics address (or with ``insecure_plaintext``):
    #: /metrics is plain HTTP, and the admin token erases tenants
    metrics_token_sha256: tuple[str, ...] = ()
    #: /metrics only for a scrape presenting one of those tokens (``Authorization: Bearer``); /healthz stays open
    metrics_require_token: bool = False
    events: str | None = None
    events_curve_secret: str | None = None
    events_name_key: str | None = None
    events_subscribers: tuple[str, ...] = ()
    #: events (not messages) kept for replay, per subscriber scope (``*`` and each tenant scope): the
    #: newest messages holding at most this many events in all (a message carries up to 1,000)
    events_buffer: int = 10000
    audit_log: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: allow tcp:// (cleartext) listeners on addresses other than loopback
    insecure_plaintext: bool = False
    #: how often blocks past their TTL are removed; the server sweeps at most every 0.05 s (a smaller
    #: value, 0 included, is taken as 0.05: kvtier/server/server.py's sweeper), so none spins
    sweep_interval_s: float = 1.0
    #: with a Mooncake fleet: how often at most the sweep begins a pass over the entries indexed at the
    #: fleet, asking it about each, the pass spread over the sweeps of this long, so that what it
    #: evicted on its own and told no one leaves the index and the fleet journal within about twice
    #: this long (found by the pass after the eviction) -- while a pass needs at most 32768 entries a
    #: sweep (over fleet_audit_interval_s / sweep_interval_s sweeps): with more entries at the fleet,
    #: a pass looks at 32768 a sweep and takes longer. Shorter costs a walk of the index's keys and a
    #: fleet lookup of each entry at the fleet, that often (kvtier/server/fleet.py's FleetAudit)
    fleet_audit_interval_s: float = 30.0
    #: SIGTERM / SIGINT: how long to copy blocks not yet on disk there before exiting
    shutdown_flush_timeout_s: float = 30.0
    #: where runtime admin changes (quotas, TTLs) persist; default: disk_dir (none: not kept)
    state_dir: str | None = None
    admin_token_sha256: tuple[str, ...] = ()
    tenants: tuple[TenantConfig, ...] = ()
    shared: tuple[SharedConfig, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    def tenant(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    @property
    def metrics_takes_admin_token(self) -> bool:
        """Whether /metrics takes the admin token: only where it does not cross the network in
        cleartext (a loopback address), or where ``insecure_plaintext`` accepts that."""
        return self.insecure_plaintext or not (self.metrics and cleartext_beyond_host("tcp://" + self.metrics))

    @property
    def tenant_connection_cap(self) -> int:
        """``max_connections_per_tenant``, or its default when 0 (see the field)."""
        return self.max_connections_per_tenant or max(1, self.max_connections // 2)


# [server] keys of the file (and KVTIER_SERVE_<KEY> variables, and --<key> flags) → field, parser
def _no_nul(v: str, what: str) -> str:
    # No path, address or name holds a NUL: the OS refuses it only at start-up, with a traceback
    if "\x00" in v:
        raise ConfigError(f"{what} = {v!r}: holds a NUL character (\\u0000); remove it")
    return v


def _str_or_none(v: Any, what: str) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise ConfigError(f"{what}: expected a string, got {v!r}")
    return _no_nul(v, what)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{what} = {v!r}: give a non-empty string")
    return _no_nul(v, what)


def _float(v: Any, what: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a number of seconds, got {v!r}") from None
    if not math.isfinite(f):   # NaN passes `< 0`, and a NaN or infinite timeout never fires as meant
        raise ConfigError(f"{what}: expected a finite number of seconds, got {v!r}")
    if f < 0:
        raise ConfigError(f"{what}: must not be negative, got {v!r}")
    return f


def _timeout(v: Any, what: str) -> float:
    f = _float(v, what)
    if f == 0:  # a zero timeout fires at once: every connection (or call) would fail
        raise ConfigError(f"{what}: must be more than 0 seconds, got {v!r}")
    if f > MAX_SECONDS:  # a wait longer than that overflows the platform's clocks (a traceback at start)
        raise ConfigError(f"{what}: at most {MAX_SECONDS} seconds (a day), got {v!r}")
    return f


def _int(v: Any, what: str) -> int:
    # bool is an int to Python (true → 1), and int(2.9) is 2: neither is what was meant
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{what}: expected a whole number, got {v!r}")
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: expected a whole number, got {v!r}") from None
    if i <= 0:
        raise ConfigError(f"{what}: must be positive, got {v!r}")
    return i


def _str_list(v: Any, what: str) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [s.strip() for s in v.split(",") if s.strip()]
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise ConfigError(f"{what}: expected a list of strings (or one comma-separated string), got {v!r}")
    return tuple(_no_nul(s, what) for s in v)


def _tenant_connection_cap(v: Any, what: str) -> int:
    # 0 is the field's "unset", but written in a file it would read as "no cap" or "no connections":
    # refused like any count below 1, with the way to the default
    if not isinstance(v, bool) and v in (0, "0"):
        raise ConfigError(f"{what}: must be positive, got {v!r}; leave it out for the default, half of "
                          f"max_connections")
    return _int(v, what)


def _bool(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{what}: expected true or false, got {v!r}")


def _ttl(v: Any, what: str) -> float | None:
    f = _float(v, what)
    return None if f == 0 else f


_SERVER_KEYS: dict[str, tuple[str, Any]] = {
    "listen": ("listen", _str_list),
    "capacity": ("capacity_bytes", parse_size),
    "max_block": ("max_block_bytes", parse_size),
    "disk_dir": ("disk_dir", _str_or_none),
    "disk_capacity": ("disk_capacity_bytes", parse_size),
    "mooncake_master": ("mooncake_master", _str_or_none),
    "mooncake_metadata": ("mooncake_metadata", _str),
    "mooncake_hostname": ("mooncake_hostname", _str),
    "mooncake_replicas": ("mooncake_replicas", _int),
    "mooncake_timeout_s": ("mooncake_timeout_s", _timeout),
    "mooncake_secret_file": ("mooncake_secret_file", _str_or_none),
    "mooncake_tenant": ("mooncake_tenant", _str),
    "encrypt_at_rest": ("encrypt_at_rest", _bool),
    "master_key_file": ("master_key_file", _str_or_none),
    "keystore_dir": ("keystore_dir", _str_or_none),
    "idle_timeout_s": ("idle_timeout_s", _timeout),
    "frame_timeout_s": ("frame_timeout_s", _timeout),
    "max_connections": ("max_connections", _int),
    "max_unauthenticated": ("max_unauthenticated", _int),
    "max_connections_per_peer": ("max_connections_per_peer", _int),
    "max_connections_per_tenant": ("max_connections_per_tenant", _tenant_connection_cap),
    "hello_timeout_s": ("hello_timeout_s", _timeout),
    "login_failure_burst": ("login_failure_burst", _int),
    "login_failure_rate_per_s": ("login_failure_rate_per_s", _float),
    "metrics": ("metrics", _str_or_none),
    "metrics_token_sha256": ("metrics_token_sha256", _str_list),
    "metrics_require_token": ("metrics_require_token", _bool),
    "events": ("events", _str_or_none),
    "events_curve_secret": ("events_curve_secret", _str_or_none),
    "events_name_key": ("events_name_key", _str_or_none),
    "events_subscribers": ("events_subscribers", _str_list),
    "events_buffer": ("events_buffer", _int),
    "audit_log": ("audit_log", _str_or_none),
    "tls_cert": ("tls_cert", _str_or_none),
    "tls_key": ("tls_key", _str_or_none),
    "insecure_plaintext": ("insecure_plaintext", _bool),
    "sweep_interval_s": ("sweep_interval_s", _float),
    "fleet_audit_interval_s": ("fleet_audit_interval_s", _timeout),
    "shutdown_flush_timeout_s": ("shutdown_flush_timeout_s", _float),
    "state_dir": ("state_dir", _str_or_none),
    "admin_token_sha256": ("admin_token_sha256", _str_list),
}
#: [server] keys that hold a secret itself (not a path to one): a file with them must be private
SECRET_KEYS = ("events_curve_secret", "events_name_key")
_TENANT_KEYS = {"name", "token_sha256", "quota", "ttl_s", "namespace_ttl_s", "read_shared"}
_SHARED_KEYS = {"name", "writers", "ttl_s"}


def _unknown(key: str, valid, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"{where}: unknown key {key!r}; {hint}valid keys are {sorted(valid)}")


def _tenant(raw: Mapping, where: str) -> TenantConfig:
    for k in raw:
        if k not in _TENANT_KEYS:
            raise _unknown(k, _TENANT_KEYS, where)
    if "name" not in raw or "token_sha256" not in raw:
        raise ConfigError(f"{where}: a tenant needs name = \"...\" and token_sha256 = [\"<kvtier admin hash-token>\"]")
    ns_ttl = raw.get("namespace_ttl_s", {})
    if not isinstance(ns_ttl, Mapping):
        raise ConfigError(f"{where}.namespace_ttl_s: expected a table like {{ scratch = 600 }}")
    return TenantConfig(
        name=str(raw["name"]),
        token_sha256=_str_list(raw["token_sha256"], f"{where}.token_sha256"),
        quota_bytes=parse_size(raw["quota"], f"{where}.quota") or None if "quota" in raw else None,
        ttl_s=_ttl(raw["ttl_s"], f"{where}.ttl_s") if "ttl_s" in raw else None,
        namespace_ttl_s={str(k): _float(v, f"{where}.namespace_ttl_s.{k}") for k, v in ns_ttl.items()},
        read_shared=_str_list(raw.get("read_shared", []), f"{where}.read_shared"),
    )


def _shared(raw: Mapping, where: str) -> SharedConfig:
    for k in raw:
        if k not in _SHARED_KEYS:
            raise _unknown(k, _SHARED_KEYS, where)
    if "name" not in raw:
        raise ConfigError(f"{where}: a shared namespace needs name = \"...\"")
    return SharedConfig(
        name=str(raw["name"]),
        writers=_str_list(raw.get("writers", []), f"{where}.writers"),
        ttl_s=_ttl(raw["ttl_s"], f"{where}.ttl_s") if "ttl_s" in raw else None,
    )


def parse_tenant_flag(text: str) -> TenantConfig:
    """``NAME=SHA256HEX[,SHA256HEX…]`` (from ``--tenant`` / ``KVTIER_SERVE_TENANTS``)."""
    name, sep, hashes = text.partition("=")
    if not sep:
        raise ConfigError(
            f"--tenant {text!r}: expected NAME=TOKEN_SHA256 (get the hash from `kvtier admin hash-token`)"
        )
    return TenantConfig(name=name.strip(), token_sha256=_str_list(hashes, f"--tenant {name}"))


#: the KVTIER_SERVE_* variables read: one per [server] key, and the tenants of --tenant
_ENV_VARS = {ENV_PREFIX + key.upper() for key in _SERVER_KEYS} | {ENV_PREFIX + "TENANTS"}


def _refuse_unknown_env(env: Mapping[str, str]) -> None:
    """A misspelt variable would be dropped without a word (a connection cap or encrypt_at_rest not
    set): refused like a misspelt [server] key of the file."""
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in _ENV_VARS:
            raise _unknown(var, _ENV_VARS, "environment")


def load_config(
    path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_tenants: tuple[TenantConfig, ...] = (),
) -> ServerConfig:
    """File, then environment (``KVTIER_SERVE_<KEY>``), then ``overrides`` (flags, same keys as [server])."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    tenants: list[TenantConfig] = []
    shared: list[SharedConfig] = []
    if path is not None:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
                server = doc.get("server")
                refuse_readable_secrets(
                    f.fileno(), os.fspath(path), [k for k in SECRET_KEYS if isinstance(server, dict) and server.get(k)],
                    "give them as $KVTIER_SERVE_EVENTS_CURVE_SECRET and $KVTIER_SERVE_EVENTS_NAME_KEY instead")
        except FileNotFoundError:
            raise ConfigError(
                f"config file {os.fspath(path)!r} does not exist; pass an existing file to --config"
            ) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {os.fspath(path)!r} is not valid TOML: {exc}") from None
        except OSError as exc:   # a directory, no permission
            raise ConfigError(f"config file {os.fspath(path)!r} cannot be read: {exc}") from None
        for section in doc:
            if section not in ("server", "admin", "tenant", "shared"):
                raise _unknown(section, ["server", "admin", "tenant", "shared"], f"{os.fspath(path)}")
        for section, fix in (("server", "write [server] once, as a table"),
                             ("admin", "write [admin] with token_sha256 = [...] under it")):
            if not isinstance(doc.get(section, {}), dict):
                raise ConfigError(f"{os.fspath(path)}: {section} must be a table ({fix}), not "
                                  f"[[{section}]] or {section} = ...")
        for key, value in doc.get("server", {}).items():
            if key not in _SERVER_KEYS or key == "admin_token_sha256":
                raise _unknown(key, set(_SERVER_KEYS) - {"admin_token_sha256"}, f"{os.fspath(path)} [server]")
            fname, parse = _SERVER_KEYS[key]
            values[fname] = parse(value, f"[server] {key}")
        for key, value in doc.get("admin", {}).items():
            if key != "token_sha256":
                raise _unknown(key, ["token_sha256"], f"{os.fspath(path)} [admin]")
            values["admin_token_sha256"] = _str_list(value, "[admin] token_sha256")
        raw_tenants = doc.get("tenant", [])
        raw_shared = doc.get("shared", [])
        if not isinstance(raw_tenants, list) or not isinstance(raw_shared, list):
            raise ConfigError("tenants and shared namespaces are arrays of tables: write [[tenant]] and [[shared]]")
        for kind, raw in (("tenant", raw_tenants), ("shared", raw_shared)):
            for i, entry in enumerate(raw):
                if not isinstance(entry, dict):
                    raise ConfigError(f"[[{kind}]] #{i + 1} is {entry!r}, not a table: write each {kind} as "
                                      f"[[{kind}]] followed by its name = \"...\" and other keys")
        tenants += [_tenant(t, f"[[tenant]] #{i + 1}") for i, t in enumerate(raw_tenants)]
        shared += [_shared(s, f"[[shared]] #{i + 1}") for i, s in enumerate(raw_shared)]
    _refuse_unknown_env(env)
    for key, (fname, parse) in _SERVER_KEYS.items():
        var = ENV_PREFIX + key.upper()
        if var in env:
            values[fname] = parse(env[var], var)
    if ENV_PREFIX + "TENANTS" in env:
        tenants += [parse_tenant_flag(t) for t in env[ENV_PREFIX + "TENANTS"].split(";") if t.strip()]
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _SERVER_KEYS:
            raise _unknown(key, _SERVER_KEYS, "flags")
        fname, parse = _SERVER_KEYS[key]
        values[fname] = parse(value, f"--{key.replace('_', '-')}")
    tenants += list(extra_tenants)
    return ServerConfig(**values, tenants=tuple(tenants), shared=tuple(shared))


def events_subscriber_scopes(c: ServerConfig) -> dict[str, str]:
    """``events_subscribers`` entries ``PUBLIC_KEY=SCOPE`` as {z85 public key: scope}."""
    out = {}
    for item in c.events_subscribers:
        key, sep, scope = item.rpartition("=")  # z85 keys may hold "=", scopes never do
        if not sep or len(key.strip()) != 40 or not scope.strip():
            raise ConfigError(
                f"events_subscribers entry {item[:20]!r}…: expected Z85_PUBLIC_KEY=SCOPE (40-character key from "
                f"`kvtier admin new-events-keys`; scope '*' for every tenant or one tenant name)"
            )
        out[key.strip()] = scope.strip()
    return out


def _validate_events(c: ServerConfig) -> None:
    if not c.events:
        return
    from kvtier.server.events import check_endpoint

    try:
        check_endpoint(c.events, curve=c.events_curve_secret is not None)
    except ValueError as exc:
        raise ConfigError(f"events: {exc}") from None
    if not c.events_name_key or not re.fullmatch(r"[0-9a-f]{32,128}", c.events_name_key):
        raise ConfigError("events: set events_name_key (32+ hex digits of secret; `kvtier admin new-events-keys`)")
    scopes = events_subscriber_scopes(c)
    if c.events_curve_secret is not None:
        if len(c.events_curve_secret) != 40:
            raise ConfigError("events_curve_secret: expected the 40-character z85 secret from "
                              "`kvtier admin new-events-keys`")
        if not scopes:
            raise ConfigError("events over CURVE: list the admitted subscribers in events_subscribers")
    tenants = {t.name for t in c.tenants}
    for scope in scopes.values():
        if scope != "*" and scope not in tenants:
            raise ConfigError(f"events_subscribers: scope {scope!r} is neither '*' nor a configured tenant")


def _validate_metrics(c: ServerConfig) -> None:
    if c.metrics:
        try:
            parse_listen("tcp://" + c.metrics)
        except ConfigError:
            raise ConfigError(f"metrics {c.metrics!r}: expected HOST:PORT, e.g. 127.0.0.1:9400") from None
    if c.metrics_require_token and not (c.admin_token_sha256 or c.metrics_token_sha256):
        raise ConfigError("metrics_require_token needs a token to scrape with: add metrics_token_sha256 (a read-only "
                          "scrape token, hashed with `kvtier admin hash-token`) or [admin] token_sha256 (or turn it off)")
    if c.metrics_require_token and not c.metrics_token_sha256 and not c.metrics_takes_admin_token:
        raise ConfigError(
            f"metrics {c.metrics!r}: plain HTTP beyond loopback would take the admin token (which erases tenants) in "
            f"cleartext on every scrape, so it is not taken there, and metrics_require_token leaves nothing to scrape "
            f"with. Add metrics_token_sha256 (a read-only scrape token: `kvtier admin new-token`), or keep metrics on "
            f"127.0.0.1; to accept cleartext anyway set insecure_plaintext = true")


def _validate(c: ServerConfig) -> None:
    # (also for a ServerConfig built in code: with_fields); 0 would begin a pass every sweep, and
    # more than a day overflows the clocks as a timeout's does
    for name in ("idle_timeout_s", "frame_timeout_s", "hello_timeout_s", "mooncake_timeout_s",
                 "fleet_audit_interval_s"):
        _timeout(getattr(c, name), name)
    for name in ("max_connections", "max_unauthenticated", "max_connections_per_peer", "login_failure_burst",
                 "mooncake_replicas", "events_buffer"):
        _int(getattr(c, name), name)
    if c.max_connections_per_tenant:  # 0: the default (see the field)
        _int(c.max_connections_per_tenant, "max_connections_per_tenant")
    if not c.listen:
        raise ConfigError("listen: give at least one address, e.g. tcp://127.0.0.1:7070 or unix:///tmp/kvtier.sock")
    for url in c.listen:
        scheme = parse_listen(url)[0]
        if scheme == "tls" and not (c.tls_cert and c.tls_key):
            raise ConfigError(f"listen {url!r} is TLS: set tls_cert and tls_key (PEM files)")
        if cleartext_beyond_host(url) and not c.insecure_plaintext:
            raise ConfigError(
                f"listen {url!r}: plain tcp:// beyond loopback sends tokens and KV blocks in cleartext. Use "
                f"tls://{url.partition('://')[2]} with tls_cert and tls_key, or unix:///PATH, or keep tcp:// on "
                f"127.0.0.1; to accept cleartext anyway pass --insecure-plaintext (insecure_plaintext = true)")
    if bool(c.tls_cert) != bool(c.tls_key):
        raise ConfigError("tls_cert and tls_key go together: set both or neither")
    if c.max_block_bytes <= 0:
        raise ConfigError("max_block must be positive, e.g. max_block = \"32MiB\"")
    if c.capacity_bytes < c.max_block_bytes:
        raise ConfigError(
            f"capacity ({c.capacity_bytes} bytes) holds no block of max_block ({c.max_block_bytes} bytes); "
            f"raise capacity or lower max_block"
        )
    if c.disk_dir and c.disk_capacity_bytes < c.max_block_bytes:
        raise ConfigError("disk_dir is set: give disk_capacity (e.g. \"100GiB\") of at least one block")
    _validate_metrics(c)
    _validate_events(c)
    if c.mooncake_master and not c.mooncake_secret_file and not c.encrypt_at_rest:
        raise ConfigError("mooncake_master: set mooncake_secret_file (a 0600 file of >= 16 random bytes; every "
                          "server sharing the fleet's blocks uses the same) or encrypt_at_rest with a master key")
    if c.encrypt_at_rest and not c.disk_dir:
        raise ConfigError("encrypt_at_rest seals the disk spill tier: set disk_dir too (the DRAM pool stays plaintext)")
    if c.encrypt_at_rest and not (c.master_key_file or os.environ.get("KVTIER_MASTER_KEY")):
        raise ConfigError("encrypt_at_rest needs a master key: set master_key_file or $KVTIER_MASTER_KEY")
    for h in c.admin_token_sha256:
        _check_hash(h, "[admin] token_sha256")
    for h in c.metrics_token_sha256:
        _check_hash(h, "metrics_token_sha256")
    names = [t.name for t in c.tenants]
    shared_names = [s.name for s in c.shared]
    for t in c.tenants:
        if not NAME_RULE.fullmatch(t.name):
            raise ConfigError(f"tenant name {t.name!r}: use 1-64 letters, digits, '.', '_' or '-'")
        if names.count(t.name) > 1:
            raise ConfigError(f"tenant {t.name!r} is defined twice; merge its token_sha256 lists into one [[tenant]]")
        if not t.token_sha256:
            raise ConfigError(f"tenant {t.name!r} has no token_sha256; add one from `kvtier admin hash-token`")
        for h in t.token_sha256:
            _check_hash(h, f"tenant {t.name!r} token_sha256")
        for s in t.read_shared:
            if s not in shared_names:
                raise ConfigError(f"tenant {t.name!r} reads shared namespace {s!r}, which no [[shared]] defines")
        for ns in t.namespace_ttl_s:
            check_tenant_namespace(ns, t.name)
    all_hashes = [h for t in c.tenants for h in t.token_sha256] + list(c.admin_token_sha256) + list(
        c.metrics_token_sha256)
    if len(set(all_hashes)) != len(all_hashes):
        raise ConfigError("the same token hash is listed twice; every token belongs to one tenant (or the admin, "
                          "or the metrics scrapers)")
    for s in c.shared:
        if not NAME_RULE.fullmatch(s.name):
            raise ConfigError(f"shared namespace name {s.name!r}: use 1-64 letters, digits, '.', '_' or '-'")
        if shared_names.count(s.name) > 1:
            # refused, not merged: the writers would be one table's and the TTL the other's
            raise ConfigError(f"shared namespace {s.name!r} is defined twice; merge its writers into one [[shared]]")
        for w in s.writers:
            if w not in names:
                raise ConfigError(f"shared namespace {s.name!r} names writer {w!r}, which is not a [[tenant]]")


def _check_hash(h: str, what: str) -> None:
    if not _HEX64.fullmatch(h):
        raise ConfigError(
            f"{what}: {h[:12]!r}… is not a SHA-256 hex digest; store `kvtier admin hash-token TOKEN`, never the token"
        )


def check_tenant_namespace(ns: str, tenant: str) -> str:
    """A namespace of ``tenant``'s own, where a setting of the tenant's (a namespace TTL) can apply: a
    ``shared/NAME`` one is refused, since its blocks are indexed under its owner ``shared/NAME``, never
    under the tenants that write it -- a TTL kept there would be accepted and never take effect."""
    check_namespace(ns)
    if ns.startswith(SHARED_PREFIX):
        name = ns[len(SHARED_PREFIX):]
        raise ConfigError(f"namespace {ns!r} of tenant {tenant!r}: the blocks of a shared namespace belong to its "
                          f"owner {ns!r}, not to the tenants that write it; set its TTL there (ttl_s in the "
                          f"[[shared]] named {name!r}, or `kvtier admin set-ttl --tenant {ns} SECONDS`)")
    return ns


def parse_listen(url: str) -> tuple[str, str, int | None]:
    """``tcp://HOST:PORT`` / ``tls://HOST:PORT`` → (scheme, host, port); ``unix:///PATH`` → ("unix", path, None)."""
    _no_nul(url, "address")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("tcp", "tls", "unix"):
        raise ConfigError(f"address {url!r}: use tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH")
    if scheme == "unix":
        if not rest.startswith("/"):
            raise ConfigError(f"address {url!r}: a unix socket needs an absolute path, unix:///PATH")
        return scheme, rest, None
    host, colon, port = rest.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {url!r}: expected {scheme}://HOST:PORT, e.g. {scheme}://127.0.0.1:7070")
    return scheme, host, int(port)


def cleartext_beyond_host(url: str) -> bool:
    """Whether ``url`` listens in cleartext on an address other hosts may reach.

    Only loopback counts as private: a host name other than ``localhost`` may
    resolve to anything (and may change), so it counts as reachable.
    """
    scheme, host, _ = parse_listen(url)
    if scheme != "tcp":
        return False  # tls:// is encrypted; unix:// is a file with permissions
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def with_fields(c: ServerConfig, **changes) -> ServerConfig:
    """A copy with some fields changed (validated again)."""
    return replace(c, **changes)


SERVER_FIELDS = {f.name for f in fields(ServerConfig)}
