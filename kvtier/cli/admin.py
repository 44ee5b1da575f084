"""``kvtier admin …``: tokens, and the authenticated admin API of a running server.

Offline::

    kvtier admin new-token            # a fresh token and the hash to put in the config
    kvtier admin hash-token < FILE    # the hash of an existing token, read from stdin

Against a server (admin token from ``--token-file PATH``, ``--token -`` (stdin) or
$KVTIER_ADMIN_TOKEN; a token given as ``--token TOKEN``, or ``hash-token TOKEN``, still works
but is visible to every local user while the command runs -- ``ps`` -- and is warned of)::

    kvtier admin --url tcp://127.0.0.1:7070 usage
    kvtier admin --url … erase --tenant acme [--namespace NS] [--session ID]
    kvtier admin --url … erase --tenant globex --offboarded  # one taken out of the config
    kvtier admin --url … set-quota --tenant acme 2GiB        # 0: no quota
    kvtier admin --url … set-ttl --tenant acme [--namespace NS] 3600   # 0: no expiry
    kvtier admin --url … set-ttl --tenant acme --namespace NS --unset  # NS follows the tenant's TTL

A namespace's TTL wins over its tenant's: ``--namespace keep 0`` keeps that namespace's blocks
even under a tenant TTL; ``--unset`` removes the namespace's own TTL (it then follows its
tenant's). A tenant's ``0`` (or ``--unset``) removes the tenant's TTL.
    kvtier admin --url … stats

``erase --tenant T --offboarded`` takes a tenant taken out of the config since, erased whole, while
the key store holds its keys (or the server found its blocks on disk at start): offboarding a tenant
and erasing it may come in either order. Without ``--offboarded`` a name not in the server's config
is refused: a key store may be shared by several servers, and an erase sent to the wrong one must
not shred the keys of a tenant another server serves.

Every admin call is recorded in the server's audit log. Output is JSON.

Exit status: 0 done; 1 refused or failed (the server's reply has ``ok`` false, or it could not
be reached); 2 a usage error; 3 (``erase`` only) partly done: the blocks the reply counts
``erased`` are gone, but the erasure is not complete -- a tier kept copies it could not remove
(``refused``), or the tenant's keys were not shredded (``keys_shredded`` false); the reply's
``error`` says what is left and what to do. A script that records an erasure as done must
check for 0, not for "not 1".
"""

from __future__ import annotations

import json
import os
import sys

from kvtier.core.units import finite_float


def register(subparsers) -> None:
    p = subparsers.add_parser("admin", help="tokens, quotas, TTLs, erasure and usage of a kvtier server")
    p.add_argument("--url", default=os.environ.get("KVTIER_URL", "tcp://127.0.0.1:7070"),
                   help="server address (default $KVTIER_URL or tcp://127.0.0.1:7070)")
    add_token_options(p, "admin token", "$KVTIER_ADMIN_TOKEN")
    p.add_argument("--timeout-s", type=finite_float, default=30.0)
    sub = p.add_subparsers(dest="admin_command", required=True)
    sub.add_parser("new-token", help="print a new random token and its SHA-256 for the config")
    sub.add_parser("new-events-keys", help="print a CURVE key pair and a block-name key for the server's KV events")
    sub.add_parser("new-subscriber-key", help="print a CURVE key pair for one KV-events subscriber (a router)")
    h = sub.add_parser("hash-token", help="print the SHA-256 of a token read from stdin")
    h.add_argument("value", nargs="?", help="the token (deprecated: visible to every local user; give it on stdin)")
    sub.add_parser("usage", help="payload bytes, blocks, and the pool bytes charged against the quota, per tenant")
    sub.add_parser("stats", help="store and tier counters")
    e = sub.add_parser("erase", help="delete every block of a tenant, or of one namespace / session of it",
                       description="Exit status 3: partly done (copies a tier could not remove, or keys not "
                                   "shredded; the reply's error says which). 0 only for a complete erasure.")
    e.add_argument("--tenant", required=True, help="tenant name, or shared/NAME for a shared namespace")
    e.add_argument("--offboarded", action="store_true",
                   help="the tenant was taken out of this server's config: erase it whole and shred its keys "
                        "(for every server sharing the key store: check it is no other server's tenant)")
    e.add_argument("--namespace")
    e.add_argument("--session")
    q = sub.add_parser("set-quota", help="set a tenant's quota (0: none)")
    q.add_argument("--tenant", required=True)
    q.add_argument("size", help="e.g. 2GiB; 0 removes the quota")
    t = sub.add_parser("set-ttl", help="set the retention of a tenant or one of its namespaces (0: no expiry)",
                       description="A namespace's TTL wins over its tenant's. 0: no expiry (a namespace's 0 keeps its "
                                   "blocks even under a tenant TTL); --unset: no TTL of its own (a namespace then "
                                   "follows its tenant's). Kept across restarts, over the config file.")
    t.add_argument("--tenant", required=True, help="tenant name, or shared/NAME for a shared namespace")
    t.add_argument("--namespace")
    what = t.add_mutually_exclusive_group(required=True)
    what.add_argument("seconds", type=finite_float, nargs="?",
                      help="seconds a block lives (0: no expiry, for a namespace even under its tenant's TTL)")
    what.add_argument("--unset", action="store_true",
                      help="remove the TTL set for it (a namespace follows its tenant's; a tenant has none)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kvtier.errors import ConfigError
    from kvtier.server.auth import hash_token, new_token
    from kvtier.core.units import parse_size

    cmd = args.admin_command
    if cmd == "new-token":
        token = new_token()
        print(json.dumps({"token": token, "token_sha256": hash_token(token)}))
        return 0
    if cmd in ("new-events-keys", "new-subscriber-key"):
        import secrets

        import zmq

        public, secret = zmq.curve_keypair()
        keys = {"public": public.decode(), "secret": secret.decode()}
        if cmd == "new-events-keys":  # the server's: secret and name key go in its 0600 config or its environment
            keys = {"events_curve_public": keys["public"], "events_curve_secret": keys["secret"],
                    "events_name_key": secrets.token_hex(32)}
        print(json.dumps(keys))
        return 0
    if cmd == "hash-token":
        in_argv = args.value not in (None, "-")
        if in_argv:
            warn_token_in_argv("kvtier admin hash-token", 'give it on stdin: echo "$TOKEN" | kvtier admin hash-token')
        value = args.value if in_argv else sys.stdin.readline().strip()
        if not value:
            print("kvtier admin hash-token: give the token on stdin", file=sys.stderr)
            return 2
        print(hash_token(value))
        return 0
    call: dict
    if cmd in ("usage", "stats"):
        call = {"cmd": cmd, "args": {}}
    elif cmd == "erase":
        call = {"cmd": "erase", "args": {"tenant": args.tenant, "namespace": args.namespace, "session": args.session,
                                         **({"offboarded": True} if args.offboarded else {})}}
    elif cmd == "set-quota":
        try:
            size = parse_size(args.size, "size")
        except ConfigError as exc:
            print(f"kvtier admin set-quota: {exc}", file=sys.stderr)
            return 2
        call = {"cmd": "set_quota", "args": {"tenant": args.tenant, "bytes": size}}
    else:
        ttl = None if args.unset else args.seconds
        call = {"cmd": "set_ttl", "args": {"tenant": args.tenant, "ttl_s": ttl, "namespace": args.namespace}}
    try:
        token = given_token(args, "kvtier admin", ("KVTIER_ADMIN_TOKEN",))
    except ConfigError as exc:
        print(f"kvtier admin: {exc}", file=sys.stderr)
        return 2
    if not token:
        print(f"kvtier admin: give the admin token with {TOKEN_WAYS.format(env='$KVTIER_ADMIN_TOKEN')}",
              file=sys.stderr)
        return 2
    if args.timeout_s <= 0:   # a deadline already passed: "did not answer in time" blamed the server
        print(f"kvtier admin: --timeout-s is seconds to wait for the server, > 0; got {args.timeout_s:g}",
              file=sys.stderr)
        return 2
    try:
        result = admin_call(args.url, token, call["cmd"], call["args"], timeout_s=args.timeout_s)
    except ConfigError as exc:   # --url is no server address: the caller's to fix, as every flag
        print(f"kvtier admin: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtier admin: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, default=str))
    if not result.get("ok", True):
        return 1
    return PARTLY_DONE if cmd == "erase" and not erase_complete(result) else 0


#: the exit status of an erase the server did only in part (see the module's docstring)
PARTLY_DONE = 3

#: the ways to give a token that keep it out of the process's arguments ({env}: the variable)
TOKEN_WAYS = "--token-file PATH, --token - (read from stdin) or {env}"


def add_token_options(parser, what: str, env: str) -> None:
    """``--token`` and ``--token-file`` for a command that sends ``what`` (read by :func:`given_token`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--token", help=f"the {what}; '-' reads it from stdin. A token given here is visible to "
                                       f"every local user while the command runs (ps): prefer --token-file or {env}")
    group.add_argument("--token-file", metavar="PATH",
                       help=f"a file holding the {what}, owned by you with mode 0600 (default: {env})")


def given_token(args, command: str, env: tuple[str, ...]) -> str | None:
    """The token ``args`` give ``command`` (its :func:`add_token_options`): ``--token-file``'s, the first
    line of stdin for ``--token -``, ``--token``'s own (a warning on stderr: the arguments of a process
    are every local user's to read), else that of the first variable of ``env`` set; None if none is.
    Raises ConfigError for a token file refused (not private, not text), and for ``--token -`` with
    no token on stdin: a secret pipe that failed (``vault … | kvtier top --token -``) or a closed stdin
    must stop the command, not run it without a token or fall back to the environment's."""
    from kvtier.errors import ConfigError

    if args.token_file is not None:
        return _token_in_file(args.token_file)
    if args.token == "-":
        token = sys.stdin.readline().strip()
        if not token:
            raise ConfigError("--token -: stdin held no token (an empty first line)")
        return token
    if args.token:
        warn_token_in_argv(command, "give it with " + TOKEN_WAYS.format(env="$" + env[0]))
        return args.token
    return next((os.environ[name] for name in env if os.environ.get(name)), None)


def warn_token_in_argv(command: str, advice: str) -> None:
    """One line on stderr: the token ``command`` was given as an argument is not secret; ``advice``: how to give it."""
    print(f"{command}: warning: a token given as an argument is visible to every local user while the command "
          f"runs (ps, /proc); {advice}", file=sys.stderr)


def _token_in_file(path: str) -> str:
    """The token held in ``path`` (surrounding whitespace, a final newline, left out), read as a secret
    (:func:`~kvtier.private_files.read_private_file`: a file only its owner may read, no symbolic link)."""
    from kvtier.errors import ConfigError
    from kvtier.private_files import read_private_file

    data = read_private_file(path, "--token-file", "give a file only you can read", why="it holds a token")
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"--token-file {path!r} is not UTF-8 text: give a file holding the token") from None
    if not token or "\n" in token:
        raise ConfigError(f"--token-file {path!r} must hold the token on one line; it holds "
                          f"{'nothing' if not token else 'several lines'}")
    return token


def erase_complete(reply: dict) -> bool:
    """Whether an erase's (ok) reply says the erasure is complete: nothing refused, no problem
    reported (keys not shredded, a fleet journal not written anew): a server says ``complete:
    false``; an older one, which does not, said it with ``refused`` or ``error``. (``keys_shredded``
    false alone is no problem: a namespace's or a session's erase shreds no keys.)"""
    return reply.get("complete", True) is not False and not reply.get("refused") and not reply.get("error")


def admin_call(url: str, token: str, cmd: str, args: dict, *, timeout_s: float = 30.0) -> dict:
    """One admin API call; raises OSError (incl. the server's refusal) on failure, ConfigError for a
    ``url`` that is no server address."""
    import time

    from kvtier.tiers.remote_protocol import Op
    from kvtier.tiers.remote_wire import RemoteError, WireClient, parse_url

    address = parse_url(url)
    try:
        client = WireClient(address, token, namespace="default", connect_timeout_s=min(timeout_s, 5.0),
                            client_name="kvtier-admin")
    except RemoteError as exc:
        raise PermissionError(f"{address} refused the admin token ({exc})") from None
    try:
        return client.call_msgpack(Op.ADMIN, {"cmd": cmd, "args": args}, deadline=time.monotonic() + timeout_s)
    except RemoteError as exc:
        raise PermissionError(str(exc)) from None
    finally:
        client.close()
