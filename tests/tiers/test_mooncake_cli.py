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
