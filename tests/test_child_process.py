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


SPAWNER_STARTER = """
import subprocess, sys, threading, time
from kvtier.child_process import Spawner, die_with_parent
spawner = Spawner()
pids = []

def start():
    if sys.argv[1] == "spawner":
        pids.append(spawner.popen(["sleep", "60"], start_new_session=True).pid)
    else:   # die_with_parent forked on this short-lived thread: the signal comes when the thread ends
        pids.append(subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=die_with_parent).pid)

t = threading.Thread(target=start)
t.start()
t.join()
time.sleep(0.5)
print(pids[0], flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_spawner_child_started_from_a_short_lived_thread_outlives_the_thread_not_the_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    starters = {mode: subprocess.Popen([sys.executable, "-c", SPAWNER_STARTER, mode], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, cwd=root) for mode in ("spawner", "thread")}
    pids = {mode: int(s.stdout.readline()) for mode, s in starters.items()}
    try:
        # control: forked on the thread that ended, the child was already signalled
        assert not _alive(pids["thread"]), "a child forked on an ended thread should have had its SIGTERM"
        assert _alive(pids["spawner"]), "the spawner's child died with the short-lived thread that asked for it"
        starters["spawner"].send_signal(signal.SIGKILL)
        starters["spawner"].wait()
        deadline = time.monotonic() + 5
        while _alive(pids["spawner"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pids["spawner"]), "the spawner's child outlived its killed process"
    finally:
        for s in starters.values():
            s.kill()
            s.wait()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_spawner_close_signals_what_it_started():
    from kvtier.child_process import Spawner

    spawner = Spawner()
    child = spawner.popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        assert child.poll() is None
        spawner.close()
        assert child.wait(5) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


LATE_STARTER = r"""
import os, subprocess, sys, time
from kvtier.child_process import die_with_parent
pidfile = sys.argv[1]
starter = os.getpid()

def late():
    # the window between fork and the child's prctl, stretched: the starter is SIGKILLed inside it
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    while os.getppid() == starter:
        time.sleep(0.01)
    die_with_parent()

subprocess.Popen(["sleep", "60"], preexec_fn=late, start_new_session=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_starter_died_before_its_prctl_does_not_run_on(tmp_path):
    """PR_SET_PDEATHSIG covers only a death after it is asked for; the child then checks that its
    parent is still the process that forked it (audit s26, D2: the child ran on with ppid 1)."""
    pidfile = tmp_path / "child.pid"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    starter = subprocess.Popen([sys.executable, "-c", LATE_STARTER, str(pidfile)], cwd=root)
    deadline = time.monotonic() + 10
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    child = int(pidfile.read_text())
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    try:
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its starter: it asked for PDEATHSIG after the starter was gone"
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_control_a_child_whose_starter_lives_runs_its_program():
    """The check after prctl does not end a child whose parent is alive, wherever it was forked."""
    from kvtier.child_process import Spawner, die_with_parent

    spawner = Spawner()
    children = [subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent), spawner.popen(["sleep", "60"])]
    try:
        time.sleep(0.3)
        for child in children:
            assert child.poll() is None
            with open(f"/proc/{child.pid}/comm") as f:
                assert f.read().strip() == "sleep"   # it got as far as exec
    finally:
        for child in children:
            child.kill()
            child.wait()
        spawner.close()


# -- remove_dead_dirs: only this host's dead owners ------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _other_host_tag() -> str:
    from kvtier.child_process import host_tag

    return "0" * 8 if host_tag() != "0" * 8 else "1" * 8


def test_an_owner_tag_reads_back_as_its_pid_here_and_as_none_for_another_host():
    from kvtier.child_process import host_tag, owner_pid, owner_tag

    tag = owner_tag()
    assert tag == f"{os.getpid()}-h{host_tag()}" and len(host_tag()) == 8
    assert owner_pid(f".name-with-dashes-{tag}") == os.getpid()
    assert owner_pid(f".name-{os.getpid()}-h{_other_host_tag()}") is None   # another host's pid: not ours
    assert owner_pid(".name-1234") == 1234                                 # a name from before the tag
    for stem in (".name", ".name-h1234abcd", ".name-12-habc", ".name-12-h1234abcd-x", ".name-12x", "1234"):
        assert owner_pid(stem) is None, stem


def test_remove_dead_dirs_sweeps_this_hosts_dead_owners_and_keeps_another_hosts(tmp_path):
    from kvtier.child_process import host_tag, owner_pid, remove_dead_dirs

    dead = _dead_pid()
    here_dead = tmp_path / f"s-{dead}-h{host_tag()}-abc"
    old_dead = tmp_path / f"s-{dead}-def"                      # named before the host tag: judged as before
    elsewhere = tmp_path / f"s-{dead}-h{_other_host_tag()}-ghi"  # its pid is another host's (or container's)
    here_live = tmp_path / f"s-{os.getpid()}-h{host_tag()}-jkl"
    for d in (here_dead, old_dead, elsewhere, here_live):
        d.mkdir()
    removed = remove_dead_dirs(tmp_path, lambda name: owner_pid(name.rpartition("-")[0]))
    assert sorted(removed) == sorted([here_dead, old_dead])
    assert elsewhere.exists() and here_live.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PID namespaces are Linux's")
def test_another_pid_namespace_has_another_host_tag():
    """Containers on one host may share its name and a cache directory; their pids are not ours."""
    from kvtier.child_process import host_tag

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "from kvtier.child_process import host_tag; print(host_tag())"
    try:
        inner = subprocess.run(["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", code], cwd=root,
                               capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pytest.skip("no unshare(1)")
    if inner.returncode != 0:
        pytest.skip(f"no user/PID namespaces here: {inner.stderr.strip()[:200]}")
    assert inner.stdout.strip() != host_tag() and len(inner.stdout.strip()) == 8
