"""`make test`'s two pytest-xdist workers (tests/xdist_groups.py): a module's shared fixture and a
conftest's session fixture are each set up once, on one worker, while the other tests go to
either worker. A real ``pytest -n 2 --dist loadgroup`` over a small suite of its own."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = '''
import os
import pytest

def pytest_configure(config):
    from tests import xdist_groups
    config.pluginmanager.register(xdist_groups, "kvtier-xdist-groups")

def setup_of(name):
    """Record a set-up of the fixture ``name`` by this worker."""
    with open(os.path.join(os.environ["SETUPS"], name), "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.fixture(scope="session")
def trace():
    setup_of("trace")
'''

MODULE_FIXTURE = '''
import time
import pytest
from conftest import setup_of

@pytest.fixture(scope="module")
def server():
    setup_of("server")

@pytest.mark.parametrize("i", range(6))
def test_uses_the_server(server, i):
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(2))
def test_without_it(i):
    time.sleep(0.2)
'''

SESSION_FIXTURE = '''
import time
import pytest

@pytest.mark.parametrize("i", range(3))
def test_uses_the_trace(trace, i):
    time.sleep(0.2)
'''

FREE = '''
import time
import pytest

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    time.sleep(0.2)
'''


def _run_suite(tmp_path: Path) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """Each fixture's set-ups (the workers that did them), and each module's tests' workers."""
    suite, setups = tmp_path / "suite", tmp_path / "setups"
    suite.mkdir()
    setups.mkdir()
    for name, text in {"conftest": CONFTEST, "test_module_fixture": MODULE_FIXTURE,
                       "test_session_a": SESSION_FIXTURE, "test_session_b": SESSION_FIXTURE,
                       "test_free": FREE}.items():
        (suite / f"{name}.py").write_text(textwrap.dedent(text))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SETUPS": str(setups), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "suite"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, test in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED suite/(\w+\.py::\w+)", done.stdout):
        workers.setdefault(test, set()).add(worker)
    assert sum(1 for _ in re.finditer(r"PASSED", done.stdout)) == 22, done.stdout[-3000:]
    return {f.name: f.read_text().split() for f in setups.iterdir()}, workers


def test_a_shared_fixture_is_set_up_once_and_its_users_share_a_worker_while_the_rest_spread(tmp_path):
    setups, workers = _run_suite(tmp_path)
    assert len(setups["server"]) == 1, setups      # not once per worker
    assert len(setups["trace"]) == 1, setups       # two modules use it: still once
    assert len(workers["test_module_fixture.py::test_uses_the_server"]) == 1, workers
    trace_users = workers["test_session_a.py::test_uses_the_trace"] | workers["test_session_b.py::test_uses_the_trace"]
    assert len(trace_users) == 1, workers
    # what shares nothing is not held to one worker
    assert workers["test_free.py::test_free"] == {"gw0", "gw1"}, workers
