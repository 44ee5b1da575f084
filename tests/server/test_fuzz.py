"""Fuzzing the server with malformed frames: 0 crashes; each frame gets an error code and a closed connection.

``KVTIER_FUZZ_FRAMES`` (default 100,000) frames in batches drawn by hypothesis,
sent over the Unix socket (and a slice over TCP); a time limit keeps ``make
test`` bounded. ``scripts/fuzz_server.py`` runs longer campaigns.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import block, hello_frame, keys_for
from tests.server.fuzzing import Outcome, frames, send_all, variants
from tests.server.harness import SHARED, TOKENS, tenants

FRAMES = int(os.environ.get("KVTIER_FUZZ_FRAMES", "100000"))
TEMPLATES = 4  # structures hypothesis draws per example
MUTANTS = 25  # frames made from each structure (see fuzzing.variants)
BATCH = TEMPLATES * MUTANTS
TIME_LIMIT_S = float(os.environ.get("KVTIER_FUZZ_TIME_LIMIT_S", "150"))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-fuzz")
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], unix=True, workdir=str(wd),
                              server={"capacity": "64MiB", "max_block": "8MiB", "max_connections": 4096,
                                      # one fuzzing client, thousands of sockets and bad logins on purpose
                                      "max_unauthenticated": 4096, "max_connections_per_peer": 4096,
                                      "login_failure_burst": 1_000_000})
    yield srv
    srv.stop()


def test_malformed_frames_get_an_error_and_a_close(fuzz_server):
    outcome = Outcome()
    hello = hello_frame(TOKENS["acme"], "fuzz")
    started = time.monotonic()
    rss_before = fuzz_server.rss_bytes()
    batches = -(-FRAMES // BATCH)

    @settings(max_examples=batches, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(frames, min_size=TEMPLATES, max_size=TEMPLATES), st.integers(0, 2**32 - 1))
    def campaign(templates, seed):
        if time.monotonic() - started > TIME_LIMIT_S:
            return
        rng = random.Random(seed)
        cases = [c for t in templates for c in variants(t, MUTANTS, rng)]
        # Every tenth batch over TCP: same server code, the other transport.
        url = fuzz_server.tcp_url if outcome.sent // BATCH % 10 == 9 else fuzz_server.unix_url
        send_all(url, cases, hello, outcome)
        assert fuzz_server.proc.poll() is None, "the server died"

    campaign()
    elapsed = time.monotonic() - started
    assert outcome.failures == [], f"{len(outcome.failures)} bad answers, e.g. {outcome.failures[:5]}"
    assert fuzz_server.proc.poll() is None, f"the server crashed:\n{fuzz_server.log()[-3000:]}"
    assert outcome.sent >= FRAMES, (
        f"only {outcome.sent} of {FRAMES} frames in the {TIME_LIMIT_S}s limit (machine too slow?)"
    )
    assert outcome.ok == outcome.sent
    assert len(outcome.codes) >= 10, outcome.codes  # every kind of breakage was exercised
    # Still serving, still correct, and no memory was kept for any of it.
    tier = RemoteTier(fuzz_server.unix_url, TOKENS["acme"], namespace="after-fuzz")
    keys = keys_for("after-fuzz", 4)
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 4
    out = np.zeros(64 * 1024, np.uint8)
    assert tier.get(keys[2], out) is Status.OK and np.array_equal(out, block(keys[2]))
    assert fuzz_server.rss_bytes() - rss_before < 64 << 20
    assert "Traceback" not in fuzz_server.log(), fuzz_server.log()[-3000:]
    print(f"fuzz: {outcome.sent} malformed frames in {elapsed:.1f}s, 0 crashes; kinds {outcome.codes}")
