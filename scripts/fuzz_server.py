#!/usr/bin/env python3
"""Long fuzzing campaigns against a real ``kvtier serve``: ``python scripts/fuzz_server.py --frames 2000000``.

The same malformed-frame strategies as ``tests/server/test_fuzz.py`` (hypothesis
structures, each multiplied by random mutations of the bytes that do not decide
its error), for as long as asked. Every frame must be answered with one ERROR
frame of an expected code and a closed connection; the server must stay up,
stay correct and not grow. Exits non-zero on the first batch with a bad answer.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier.server.launch import ServerProcess  # noqa: E402
from tests.server.conftest import hello_frame  # noqa: E402
from tests.server.fuzzing import Outcome, frames, send_all, variants  # noqa: E402
from tests.server.harness import SHARED, TOKENS, tenants  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=1_000_000)
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this long whatever the count")
    p.add_argument("--mutants", type=int, default=25, help="frames made from each hypothesis structure")
    p.add_argument("--seed", type=int, default=None, help="seed of the campaign seeds (default: random)")
    p.add_argument("--tcp-share", type=float, default=0.1, help="fraction of batches sent over TCP")
    args = p.parse_args()

    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], unix=True,
                              server={"capacity": "64MiB", "max_block": "8MiB", "max_connections": 4096})
    outcome = Outcome()
    hello = hello_frame(TOKENS["acme"], "fuzz")
    started = time.monotonic()
    rss0 = srv.rss_bytes()
    pick = random.Random(args.seed)
    try:
        round_no = 0
        while outcome.sent < args.frames and time.monotonic() - started < args.minutes * 60:
            # Bounded hypothesis campaigns, each from its own seed, until the count or the time is reached.
            @seed(pick.getrandbits(64))
            @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(st.lists(frames, min_size=4, max_size=4), st.integers(0, 2**32 - 1))
            def campaign(templates, mutation_seed):
                cases = [c for t in templates for c in variants(t, args.mutants, random.Random(mutation_seed))]
                url = srv.tcp_url if pick.random() < args.tcp_share else srv.unix_url
                send_all(url, cases, hello, outcome)
                if outcome.failures or srv.proc.poll() is not None:
                    raise AssertionError("bad answer or dead server")

            try:
                campaign()
            except AssertionError:
                break
            round_no += 1
            rate = outcome.sent / (time.monotonic() - started)
            print(f"round {round_no}: {outcome.sent} frames, {rate:.0f}/s, server RSS {srv.rss_bytes() >> 20} MiB",
                  flush=True)
        alive = srv.proc.poll() is None
        print(f"sent {outcome.sent}, answered correctly {outcome.ok}, failures {len(outcome.failures)}, "
              f"server {'alive' if alive else 'DEAD'}, "
              f"RSS {rss0 >> 20} -> {srv.rss_bytes() >> 20 if alive else '?'} MiB")
        for f in outcome.failures[:20]:
            print("  ", f)
        print("kinds:", outcome.codes)
        return 0 if alive and not outcome.failures else 1
    finally:
        if srv.proc.poll() is not None:
            print(srv.log()[-3000:], file=sys.stderr)
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
