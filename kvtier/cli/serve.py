"""``kvtier serve``: run the shared context-memory server.

Configuration comes from ``--config FILE`` (TOML, see :mod:`kvtier.server.config`),
then ``KVTIER_SERVE_*`` environment variables, then these flags. Once listening it
prints one JSON line with the bound addresses (``"ready": true``) on stdout.
"""

from __future__ import annotations

import errno
import json
import logging
import sys

from kvtier.core.units import finite_float

# flag → [server] key of the config file
_FLAGS = {
    "listen": "listen",
    "capacity": "capacity",
    "max_block": "max_block",
    "disk_dir": "disk_dir",
    "disk_capacity": "disk_capacity",
    "mooncake_master": "mooncake_master",
    "mooncake_metadata": "mooncake_metadata",
    "mooncake_secret_file": "mooncake_secret_file",
    "idle_timeout_s": "idle_timeout_s",
    "frame_timeout_s": "frame_timeout_s",
    "max_connections": "max_connections",
    "metrics": "metrics",
    "events": "events",
    "events_subscriber": "events_subscribers",
    "audit_log": "audit_log",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "insecure_plaintext": "insecure_plaintext",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the shared context-memory server",
        description="Serve a shared KV-cache tier to many inference workers (see README: 'Shared server').",
    )
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--listen", action="append", metavar="URL",
                   help="tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH (repeatable; default tcp://127.0.0.1:7070)")
    p.add_argument("--capacity", metavar="SIZE", help="host DRAM pool, e.g. 8GiB")
    p.add_argument("--max-block", metavar="SIZE",
                   help="largest block accepted, e.g. 32MiB (not what each block costs: blocks take whole pages "
                        "of their own size); end-to-end sealed blocks need room for the seal: "
                        "kvtier.crypto.aead.sealed_stream_nbytes(SIZE)")
    p.add_argument("--disk-dir", metavar="DIR", help="spill tier directory (local NVMe or shared mount)")
    p.add_argument("--disk-capacity", metavar="SIZE", help="spill tier capacity, e.g. 500GiB")
    p.add_argument("--mooncake-master", metavar="HOST:PORT",
                   help="spill below DRAM/disk to a Mooncake Store fleet (its master's RPC address)")
    p.add_argument("--mooncake-metadata", metavar="URL", help="the fleet's metadata server, http://host:port/metadata")
    p.add_argument("--mooncake-secret-file", metavar="PATH",
                   help="0600 file of >= 16 random bytes keying the fleet's block names (same on every server)")
    p.add_argument("--idle-timeout-s", type=finite_float, help="close connections idle this long (default 300)")
    p.add_argument("--frame-timeout-s", type=finite_float,
                   help="close connections whose frame takes this long (default 30)")
    p.add_argument("--max-connections", type=int)
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus /metrics and /healthz here")
    p.add_argument("--events", metavar="ENDPOINT",
                   help="serve KV events (and their replay) to admitted subscribers: tcp://HOST:PORT with CURVE "
                        "keys ($KVTIER_SERVE_EVENTS_CURVE_SECRET, $KVTIER_SERVE_EVENTS_NAME_KEY from "
                        "`kvtier admin new-events-keys`) or ipc:///PATH (a 0600 socket)")
    p.add_argument("--events-subscriber", action="append", metavar="Z85_PUBLIC_KEY=SCOPE",
                   help="admit a KV-events subscriber (repeatable); SCOPE is '*' (every tenant) or a tenant name")
    p.add_argument("--audit-log", metavar="PATH", help="append audit records (JSON lines) here")
    p.add_argument("--tls-cert", metavar="PEM")
    p.add_argument("--tls-key", metavar="PEM")
    # store_const, not store_true: an absent flag must not override `insecure_plaintext = true` in the file
    p.add_argument("--insecure-plaintext", action="store_const", const=True, default=None,
                   help="allow tcp:// (cleartext) listen addresses other than loopback; prefer tls://")
    p.add_argument("--tenant", action="append", metavar="NAME=TOKEN_SHA256",
                   help="add a tenant (repeatable); hash tokens with `kvtier admin hash-token`")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kvtier.errors import ConfigError
    from kvtier.server.config import load_config, parse_tenant_flag

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {key: getattr(args, flag) for flag, key in _FLAGS.items()}
    try:
        tenants = tuple(parse_tenant_flag(t) for t in args.tenant or ())
        config = load_config(args.config, overrides=overrides, extra_tenants=tenants)
        if not config.tenants and not config.admin_token_sha256:
            raise ConfigError(
                "no tenants configured: nobody could connect. Add [[tenant]] to --config, or "
                "--tenant NAME=$(kvtier admin hash-token \"$KVTIER_TOKEN\")"
            )
    except ConfigError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2

    from kvtier.server.server import run

    def ready(addresses: dict) -> None:
        print(json.dumps({"ready": True, **addresses}), flush=True)

    try:
        run(config, ready)
    except OSError as exc:
        # Binding is not the only start-up step that can fail so (a TLS key, the audit log, a disk
        # directory, a secret file): the advice about ports fits only an address in use.
        hint = ("; pick a free port or remove the socket file" if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
                else "")
        print(f"kvtier serve: cannot start ({exc}){hint}", file=sys.stderr)
        return 1
    except ValueError as exc:
        # A setting the config checks let through but the OS refuses (a NUL in a path: "embedded
        # null byte") is still a bad setting: one line and exit 2, not a traceback.
        print(f"kvtier serve: cannot start, a setting is invalid ({exc})", file=sys.stderr)
        return 2
    return 0
