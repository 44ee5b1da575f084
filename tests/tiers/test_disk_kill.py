"""SIGKILL a disk-tier writer at random moments: no torn or wrong block ever becomes visible.

A real ``python`` process writes blocks whose content follows from the key
(:mod:`tests.tiers.disk_writer`), under a capacity small enough that it also
evicts while it writes; it is killed with SIGKILL many times, each restart
recovering the directory the last one left. Afterwards a fresh tier must read
every block it finds with exactly the expected bytes.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from tests.tiers.disk_writer import content_of, key_of, size_of

ROOT = Path(__file__).resolve().parents[2]
KILLS = 24
KEYS = 150
CAPACITY = 3 << 20  # ~40 blocks of the ~150 keys: the writer evicts all the time


def _verify_directory(path: Path) -> tuple[int, list[str]]:
    """Open a fresh tier on ``path`` and read every block it finds: (blocks, problems)."""
    index = {key_of(i): i for i in range(KEYS)}
    problems = []
    with DiskTier(path, 1 << 30) as tier:
        keys = list(tier.keys())
        for key in keys:
            if key not in index:
                problems.append(f"a block under a name no writer used: {key.hex()}")
                continue
            out = np.empty(size_of(key), np.uint8)
            status = tier.get(key, out)
            if status is not Status.OK or not np.array_equal(out, content_of(key)):
                problems.append(f"block {index[key]}: {status.name}")
        if tier.stats.verify_failures:  # includes files dropped at open as implausible
            problems.append(f"{tier.stats.verify_failures} files failed verification")
        if any(path.rglob("*.tmp")):
            problems.append("dead writers' temp files survived a restart")
        tier.check_integrity(deep=True)
    return len(keys), problems


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 6], ids=["file-per-block", "packed-extents"])
def test_sigkill_at_random_moments_never_leaves_a_torn_or_wrong_block(tmp_path, batch):
    rng = random.Random(20261202)
    torn_left = 0  # kills that caught a write in flight (a temp file left behind)
    quota = KILLS if batch == 1 else KILLS // 2
    # up to 4x the quota while no kill has landed mid-write yet (a loaded machine can make the
    # first ones all land between writes): the control below still has to be met
    for n in range(4 * quota):
        if n >= quota and torn_left > 0:
            break
        writer = subprocess.Popen(
            [sys.executable, "-m", "tests.tiers.disk_writer", str(tmp_path), "--loop", "--batch", str(batch),
             "--keys", str(KEYS), "--capacity", str(CAPACITY), "--seed", str(n)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        ready = writer.stdout.readline().strip()
        assert ready == "ready", writer.communicate()[1]
        time.sleep(rng.uniform(0.0, 0.12))
        writer.send_signal(signal.SIGKILL)
        _, err = writer.communicate(timeout=30)
        assert writer.returncode == -signal.SIGKILL, f"writer exited by itself: {err}"
        torn_left += any(tmp_path.rglob("*.tmp"))
        # What a restart right now would see (the next writer also starts from it).
        blocks, problems = _verify_directory(tmp_path)
        assert problems == [], f"after kill {n + 1}: {problems[:5]}"
        assert not (tmp_path / "WRONG").exists(), "a writer read back wrong bytes"

    assert torn_left > 0, "no kill landed mid-write; the test proves nothing"
    assert blocks > 0, "the writers stored nothing"
    if batch > 1:
        assert any(tmp_path.rglob("*.kvx")), "no extent was written: the packed path went untested"
