"""``kvtier mooncake up`` starts a master and holders a store can use, and stops them on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


def test_mooncake_up_serves_a_tier_and_stops_everything_on_sigterm(tmp_path):
    from kvtier.tiers.mooncake import MooncakeTier

    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "mooncake", "up", "--holders", "2",
                             "--segment", "64MiB", "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["ready"] and info["holders"] == 2
        tier = MooncakeTier(info["master"], info["metadata"], tenant="t", secret=os.urandom(32))
        try:
            data = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
            assert tier.put(b"k" * 32, data) is Status.OK
            out = np.zeros_like(data)
            assert tier.get(b"k" * 32, out) is Status.OK and np.array_equal(out, data)
        finally:
            tier.close()
        pids = [int((tmp_path / f"holder{i}.ready").read_text()) for i in range(2)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in pids:  # the holders went with it
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("ttl", ["-1", "0"])
def test_a_client_ttl_below_one_second_is_refused_before_anything_starts(tmp_path, ttl):
    """The master takes a negative TTL and drops every holder at once: ``up`` said ready, puts
    answered OK and every block was gone 2 s later. At 0 it drops a holder that misses one
    heartbeat. Refused like ``--holders 0``, with exit 2 and nothing started."""
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "mooncake", "up", "--holders", "1",
                             "--segment", "32MiB", "--client-ttl-s", ttl, "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out = proc.stdout.readline()  # "ready" if it started a fleet; empty once it exits
        assert not out, f"--client-ttl-s {ttl}: {out}"
        assert proc.wait(30) == 2
        assert "--client-ttl-s must be 1 or more" in proc.stderr.read()
        assert not list(tmp_path.iterdir())  # no master, no holder
    finally:
        if proc.poll() is None:  # started one: stop it and all it started
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
