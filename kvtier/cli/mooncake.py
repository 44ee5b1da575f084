"""``kvtier mooncake up``: a Mooncake Store (master + N segment holders) on this machine, for trying it out.

It prints one JSON line with what a store needs to reach it (``"ready": true``, the
master's address, the metadata URL, the StoreConfig settings) and runs until
SIGINT/SIGTERM, then stops every process it started. Loopback only: for a fleet,
run ``mooncake_master`` and ``python -m kvtier.tiers.mooncake_launch holder`` on the
nodes themselves (README: "Mooncake fleet").
"""

from __future__ import annotations

import json
import signal
import sys
import time

from kvtier.core.units import parse_size


def register(subparsers) -> None:
    p = subparsers.add_parser("mooncake", help="run a local Mooncake Store for trying the Mooncake tier",
                              description="Start a Mooncake Store (master + segment holders) on loopback.")
    sub = p.add_subparsers(dest="mooncake_command", required=True)
    up = sub.add_parser("up", help="start a master and N segment holders on loopback; Ctrl-C stops them")
    up.add_argument("--holders", type=int, default=2, help="segment-holder processes (default 2)")
    up.add_argument("--segment", default="1GiB", help="memory each holder contributes (default 1GiB)")
    up.add_argument("--client-ttl-s", type=int, default=10,
                    help="seconds the master waits before dropping a silent holder (default 10; 1 or more)")
    up.add_argument("--workdir", help="where logs go (default: a temporary directory, removed at exit)")
    up.set_defaults(func=_up)


#: the smallest segment a Mooncake holder accepts ("Total size must be at least 16777216")
MIN_SEGMENT_BYTES = 16 << 20


def _up(args) -> int:
    if args.holders < 1:
        print("kvtier mooncake up: --holders must be 1 or more", file=sys.stderr)
        return 2
    if args.client_ttl_s < 1:
        # The master takes any number: below 0 it drops every holder at once (a fleet that says
        # ready, answers OK to puts and loses every block within seconds); at 0 it drops a holder
        # as soon as it misses a heartbeat (a killed one was gone within 2 s, against 5-7 s at 3),
        # so a holder that merely paused would lose its blocks.
        print(f"kvtier mooncake up: --client-ttl-s must be 1 or more, the seconds the master keeps a "
              f"silent holder's blocks (got {args.client_ttl_s})", file=sys.stderr)
        return 2
    segment = parse_size(args.segment, "--segment")
    if segment < MIN_SEGMENT_BYTES:
        print(f"kvtier mooncake up: --segment must be at least 16MiB, Mooncake's minimum (got {args.segment})",
              file=sys.stderr)
        return 2
    from kvtier.tiers.mooncake_launch import MooncakeCluster
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster = MooncakeCluster.start(holders=args.holders, segment_bytes=segment, workdir=args.workdir,
                                        master_flags=[f"--client_ttl={args.client_ttl_s}"])
    except (RuntimeError, OSError) as exc:
        # a master or holder that exited or hung at start (the others are stopped): the first line
        # of why, not a traceback over a page of its log
        where = f"; logs in {args.workdir}" if args.workdir else " (rerun with --workdir DIR to keep the logs)"
        print(f"kvtier mooncake up: could not start: {str(exc).splitlines()[0] if str(exc) else exc!r}{where}",
              file=sys.stderr)
        return 1
    try:
        print(json.dumps({
            "ready": True,
            "master": cluster.master_address,
            "metadata": cluster.metadata_url,
            "holders": args.holders,
            "segment_bytes": segment,
            "logs": str(cluster.workdir),
            "store_config": {"mooncake_master": cluster.master_address, "mooncake_metadata": cluster.metadata_url},
        }), flush=True)
        while not stop:
            if cluster.master.poll() is not None:
                print(f"kvtier mooncake up: mooncake_master exited ({cluster.master.returncode}); "
                      f"see {cluster.workdir}/master.log", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        cluster.stop()
