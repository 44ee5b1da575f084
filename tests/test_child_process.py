"""die_with_parent: a child started with it goes when its starter is SIGKILLed; one started
without it (the positive control) outlives its starter, as the orphaned holders did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

STARTER = """
import subprocess, sys
from kvtier.child_process import die_with_parent
kw = {"preexec_fn": die_with_parent} if sys.argv[1] == "with" else {}
child = subprocess.Popen(["sleep", "60"], start_new_session=True, **kw)
print(child.pid, flush=True)
sys.stdin.read()  # lives until killed
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (dead, not yet reaped by init) is gone
        return f.read().split(")")[-1].split()[0] != "Z"


def _orphan_after_kill(mode: str) -> int:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pid = int(starter.stdout.readline())
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    return pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_killed_starter_and_without_it_survives():
    with_it = _orphan_after_kill("with")
    without = _orphan_after_kill("without")
    try:
        deadline = time.monotonic() + 5
        while _alive(with_it) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(with_it), "a child started with die_with_parent outlived its killed starter"
        assert _alive(without), "control: a child started without it should have survived"
    finally:
        for pid in (with_it, without):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
