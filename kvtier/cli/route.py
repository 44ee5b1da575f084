"""``kvtier route``: the KV-aware OpenAI-compatible router in front of several vLLM workers.

Workers come from ``--worker URL[,events=ENDPOINT]`` (repeatable) and/or a TOML
``--config`` file (``[[worker]] url = … events = …`` plus any RouterConfig setting);
flags win. Once listening it prints one JSON line (``"ready": true``) on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from kvtier.core.units import finite_float

# flag dest → RouterConfig field (given flags only override the file)
_FLAGS = ("host", "port", "policy", "model_path", "block_tokens", "kv_bytes_per_token", "host_read_bytes_per_s",
          "shared_read_bytes_per_s", "shared_events", "shared_events_server_public", "shared_events_public",
          "shared_events_secret_file", "prefill_tokens_per_s", "decode_block_s", "step_tokens", "admission_tokens",
          "temperature",
          "index_capacity",
          "health_interval_s", "eject_after", "max_attempts", "drain_timeout_s", "max_held", "max_body_bytes",
          "max_form_body_bytes", "max_route_tokens", "body_timeout_s", "header_timeout_s", "keepalive_timeout_s",
          "max_connections_per_peer", "max_inflight_body_bytes", "max_arriving_body_bytes_per_peer")


def register(subparsers) -> None:
    p = subparsers.add_parser("route", help="run the KV-aware router (OpenAI-compatible) in front of vLLM workers",
                              description="Send each request to the worker whose tiers already hold its context.")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--worker", action="append", default=[], metavar="URL[,events=ENDPOINT]",
                   help="a worker's base URL and, optionally, its vLLM KV-events ZMQ endpoint (repeat)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--policy", choices=["round-robin", "least-loaded", "approximate", "prefix", "tier-aware"])
    p.add_argument("--model-path", dest="model_path", help="local model folder: tokenizer and chat template")
    p.add_argument("--block-tokens", dest="block_tokens", type=int, help="the workers' vLLM --block-size")
    p.add_argument("--kv-bytes-per-token", dest="kv_bytes_per_token", type=int)
    p.add_argument("--host-bandwidth", dest="host_read_bytes_per_s", type=finite_float,
                   help="bytes/s, host DRAM → GPU")
    p.add_argument("--shared-bandwidth", dest="shared_read_bytes_per_s", type=finite_float,
                   help="bytes/s, shared tier → worker")
    p.add_argument("--measured", action="append", default=[], metavar="FILE",
                   help="bandwidths measured on this deployment: the JSON of `kvtier bench storage --tier host "
                        "--json` (host DRAM) or `kvtier bench remote --json` (shared tier); repeatable; "
                        "--host-bandwidth / --shared-bandwidth win")
    p.add_argument("--shared-writes", action="store_true", default=None,
                   help="workers write what they compute through to a shared tier every worker loads from")
    p.add_argument("--shared-events", dest="shared_events", help="the kvtier server's events endpoint")
    p.add_argument("--shared-events-server-public", dest="shared_events_server_public")
    p.add_argument("--shared-events-public", dest="shared_events_public")
    p.add_argument("--shared-events-secret-file", dest="shared_events_secret_file", metavar="PATH",
                   help="a 0600 file holding the router's z85 CURVE secret (or $KVTIER_ROUTER_EVENTS_SECRET)")
    p.add_argument("--shared-events-secret", action=_SecretOnArgv, help=argparse.SUPPRESS)
    p.add_argument("--prefill-tokens-per-s", dest="prefill_tokens_per_s", type=finite_float)
    p.add_argument("--decode-block-s", dest="decode_block_s", type=finite_float,
                   help="decode pressure, seconds per active block, until the router has measured the worker's "
                        "decode step from its streams")
    p.add_argument("--step-tokens", dest="step_tokens", type=int,
                   help="the workers' prefill step budget, vLLM's --max-num-batched-tokens (default 2048, vLLM's "
                        "on CPU): requests queued together share steps, so tier-aware prices what a request adds "
                        "to the first tokens of those it would share a step with; 0: the workers share no steps")
    p.add_argument("--admission-tokens", dest="admission_tokens", type=int,
                   help="predicted uncached tokens sent to a worker at a time; its further requests wait in the "
                        "router and go soonest-finishing first (e.g. --step-tokens' 2048; default 0: send every "
                        "request at once)")
    p.add_argument("--max-held", dest="max_held", type=int,
                   help="with --admission-tokens: the most requests held in the router at once, all workers "
                        "together; one more that would wait is answered 429 at once (default 1000)")
    p.add_argument("--max-body-bytes", dest="max_body_bytes", metavar="SIZE",
                   help="the largest request body taken, e.g. 16MiB (the default: a prompt of 1 M token ids "
                        "twice over); a larger one is answered 413")
    p.add_argument("--max-form-body-bytes", dest="max_form_body_bytes", metavar="SIZE",
                   help="the largest multipart form taken on the speech-to-text endpoints (/v1/audio/transcriptions, "
                        "/v1/audio/translations), e.g. 40MiB (default 32MiB: vLLM's 25 MiB audio file and its form, "
                        "lowered when unset to fit --max-inflight-body-bytes and --max-arriving-body-bytes-per-peer); a "
                        "larger one is answered 413. Set, at most those bounds, else the start is refused")
    p.add_argument("--max-route-tokens", dest="max_route_tokens", type=int,
                   help="the leading tokens of a prompt tokenized and keyed to route it (default 262144); the "
                        "worker still gets the whole prompt. Raise it to the workers' max_model_len if longer")
    p.add_argument("--body-timeout-s", dest="body_timeout_s", type=finite_float,
                   help="the longest a client may take to send a request's body (default 60); then 408 and "
                        "the connection closed")
    p.add_argument("--header-timeout-s", dest="header_timeout_s", type=finite_float,
                   help="the longest a new connection may go without sending a whole request head (default 5); "
                        "then it is closed")
    p.add_argument("--keepalive-timeout-s", dest="keepalive_timeout_s", type=finite_float,
                   help="the longest a kept-alive connection may stay idle between requests (default 75, longer "
                        "than clients keep pooled connections); then it is closed")
    p.add_argument("--max-connections-per-peer", dest="max_connections_per_peer", type=int,
                   help="the most connections one client address may hold (default 0: a quarter of the open-file "
                        "limit); past it, its longest idle one is closed. Raise it behind a proxy")
    p.add_argument("--max-inflight-body-bytes", dest="max_inflight_body_bytes", metavar="SIZE",
                   help="the request bodies held at once, every request's together, counted as they arrive "
                        "(default 1GiB); past it, 429")
    p.add_argument("--max-arriving-body-bytes-per-peer", dest="max_arriving_body_bytes_per_peer", metavar="SIZE",
                   help="the request bodies one client address may have begun and not finished sending (default 0: "
                        "an eighth of --max-inflight-body-bytes); past it, 429. Raise it behind a proxy")
    p.add_argument("--temperature", type=finite_float, help="softmax temperature of tier-aware (0: take the minimum)")
    p.add_argument("--index-capacity", dest="index_capacity", type=int)
    p.add_argument("--health-interval-s", dest="health_interval_s", type=finite_float)
    p.add_argument("--eject-after", dest="eject_after", type=int)
    p.add_argument("--max-attempts", dest="max_attempts", type=int)
    p.add_argument("--drain-timeout-s", dest="drain_timeout_s", type=finite_float,
                   help="at shutdown, how long answers under way may go on before each is ended with an error "
                        "event (or a 503) and aborted on its worker (default 25: under Kubernetes' 30 s grace)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug: one line per decision with each worker's backlog and cost")
    p.set_defaults(func=run)


class _SecretOnArgv(argparse.Action):
    """``--shared-events-secret``: refused, naming where the secret goes instead. A command line is
    public (``ps``, ``/proc/PID/cmdline``), and whoever holds this secret subscribes to every
    tenant's events as the router."""

    def __call__(self, parser, namespace, values, option_string=None):
        from kvtier.router.config import SECRETS_ENV

        parser.error(f"{option_string} would put the CURVE secret on the command line, which every local user can "
                     f"read (ps); give it as ${SECRETS_ENV} or in a 0600 file: --shared-events-secret-file PATH")


def build_config(args):
    from kvtier.router.config import SECRETS_ENV, RouterConfig, WorkerSpec

    config = RouterConfig.from_file(args.config) if args.config else RouterConfig()
    for name in _FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            config.set_explicitly(name, value)
    config.measured.extend(args.measured)
    if args.shared_writes:
        config.shared_writes = True
    config.workers.extend(WorkerSpec.parse(w) for w in args.worker)
    # the workers' --api-key, for the router's own calls to them (a flag would show in `ps`)
    config.worker_api_key = os.environ.get("KVTIER_WORKER_API_KEY") or config.worker_api_key
    # the CURVE secret likewise: --shared-events-secret-file, else the environment, else the config file's
    if getattr(args, "shared_events_secret_file", None) is not None:
        config.shared_events_secret = None
    elif os.environ.get(SECRETS_ENV):
        config.shared_events_secret, config.shared_events_secret_file = os.environ[SECRETS_ENV], None
    return config.check()


def run(args) -> int:
    from kvtier.errors import ConfigError
    from kvtier.open_file_limit import raise_open_file_limit
    from kvtier.router.app import Router
    from kvtier.router.requests import PromptTokenizer

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_file_limit()   # before the Router: its default connections per address follow the limit
    try:
        config = build_config(args)
        if not config.model_path:
            raise ConfigError("--model-path is required: the router tokenizes with the model's own tokenizer")
        block_bytes = None
        if config.kv_bytes_per_token is None:
            from kvtier.planner.models import load_model

            block_bytes = load_model(config.model_path).block_bytes(config.block_tokens)
        router = Router(config, PromptTokenizer(config.model_path), block_bytes=block_bytes)
    except ConfigError as exc:
        print(f"kvtier route: {exc}", file=sys.stderr)
        return 2

    # Bound and listening before the ready line, which then names the port a --port 0 got and is
    # printed only once connections are queued (aiohttp's own bind comes after its startup hooks).
    try:
        socks = _listen(config.host, config.port)
    except OSError as exc:
        print(f"kvtier route: cannot listen on {config.host}:{config.port} ({exc}); pick a free port or "
              f"an address of this host", file=sys.stderr)
        return 1
    host, port = socks[0].getsockname()[:2]
    host = f"[{host}]" if ":" in host else host

    async def announce(app):
        print(json.dumps({"ready": True, "listen": f"http://{host}:{port}", "policy": config.policy,
                          "workers": [w.url for w in config.workers],
                          "read_bytes_per_s": {tier: {"value": v, "source": src}
                                               for tier, (v, src) in config.read_bandwidths().items()}}),
              flush=True)

    runner = router.runner(handle_signals=True, access_log=None)
    runner.app.on_startup.append(announce)
    runner.app.on_startup.append(_second_signal_hurries_the_drain(router))
    _serve(runner, socks)
    return 0


def _serve(runner, socks: list) -> None:
    """aiohttp's ``web.run_app`` over ``runner`` (:meth:`Router.runner`, which bounds connections
    per client address: ``run_app`` builds a plain runner of its own and takes none), in its
    order: a signal's ``GracefulExit`` ends the wait, the runner is cleaned up (the drain), then
    every task left is cancelled and the loop closed; ``GracefulExit`` raised during the cleanup
    (one more signal) cuts it short, as under ``run_app``."""
    import asyncio
    import contextlib

    from aiohttp import web

    async def serve() -> None:
        await runner.setup()
        try:
            for sock in socks:
                await web.SockSite(runner, sock).start()
            await asyncio.Event().wait()   # until a signal
        finally:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    main = loop.create_task(serve())
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def _second_signal_hurries_the_drain(router):
    """A startup hook: the first SIGTERM or SIGINT shuts down as aiohttp's own handler does
    (``GracefulExit``: the drain, then cleanup); the second ends the drain early
    (:meth:`Router.end_drain`) and leaves the rest of the cleanup (aborts, sessions) alone; one
    more, or a second once no drain is left to end, stops at once as aiohttp's does (requests
    the drain does not hold, a client still sending its body, would keep the router up to
    aiohttp's shutdown timeout, 60 s, that no signal could end). aiohttp's handler stays
    installed until its cleanup ends, and raised again out of it: the drain was abandoned, the
    answers in flight cut without an error event, 503 or abort."""
    import asyncio
    import signal

    from aiohttp import web

    async def install(app) -> None:
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 2 and router.end_drain():
                return
            raise web.GracefulExit()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):   # replaces aiohttp's; its cleanup removes them at the end
            loop.add_signal_handler(sig, on_signal)

    return install


def _listen(host: str, port: int) -> list:
    """TCP sockets bound to every address ``host`` resolves to (``localhost``: 127.0.0.1 and ::1,
    as aiohttp's own bind does) on ``port``, listening; with port 0 the first one's port for all."""
    import socket

    socks: list[socket.socket] = []
    try:
        seen = set()
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:   # its own family only, so that the IPv4 address binds too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            chosen = socks[0].getsockname()[1] if len(socks) > 1 else address[1]
            sock.bind((address[0], chosen, *address[2:]))
            sock.listen(1024)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks
