"""`make demo` on a fresh Debian (audit s26 D12): Debian's python3 has no ensurepip (it is in
python3.X-venv), so `python3 -m venv` fails; the Makefile installs the package first.

The `venvdeps` recipe really runs here, with a fake PYTHON (Debian's, without ensurepip) and a
fake SUDO that records the apt-get commands instead of running them: no venv is made."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    for name in ("Makefile", "pyproject.toml", "setup.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def _debian_python(tree: Path) -> Path:
    """Debian's python3 without python3-venv: `import ensurepip` fails, `-m venv` fails."""
    return _script(tree / "python3-debian", "case \"$*\" in *ensurepip*|*'-m venv'*) "
                                            "echo 'No module named ensurepip' >&2; exit 1;; esac\n"
                                            f"exec {sys.executable} \"$@\"\n")


def _fake_sudo(tree: Path, fail_on: str = "@none@") -> Path:
    """Records each command it is given in apt.log; fails for one that names ``fail_on``."""
    return _script(tree / "fake-sudo", f"echo \"$*\" >> {tree}/apt.log\n"
                                       f"case \"$*\" in *{fail_on}*) exit 100;; esac\nexit 0\n")


def _venvdeps(tree: Path, python: Path | str, sudo: Path) -> tuple[int, list[str]]:
    r = subprocess.run(["make", "venvdeps", f"PYTHON={python}", f"SUDO={sudo}"], cwd=tree, capture_output=True,
                       text=True, timeout=60)
    log = tree / "apt.log"
    return r.returncode, log.read_text().splitlines() if log.exists() else []


def test_a_python_without_ensurepip_gets_its_venv_package_from_apt(tree):
    rc, apt = _venvdeps(tree, _debian_python(tree), _fake_sudo(tree))
    version = "%d.%d" % sys.version_info[:2]
    assert rc == 0
    # old Makefile: no venvdeps target at all (make: *** No rule to make target 'venvdeps')
    assert apt == ["apt-get update -qq", f"apt-get install -y -qq python{version}-venv"], apt


def test_without_a_versioned_package_python3_venv_is_installed(tree):
    version = "%d.%d" % sys.version_info[:2]
    rc, apt = _venvdeps(tree, _debian_python(tree), _fake_sudo(tree, fail_on=f"python{version}-venv"))
    assert rc == 0 and apt[-1] == "apt-get install -y -qq python3-venv", apt


def test_an_apt_failure_stops_make_before_the_venv(tree):
    rc, apt = _venvdeps(tree, _debian_python(tree), _fake_sudo(tree, fail_on="install"))
    assert rc != 0 and len(apt) == 3, apt


def test_control_a_python_with_ensurepip_installs_nothing(tree):
    rc, apt = _venvdeps(tree, sys.executable, _fake_sudo(tree))
    assert rc == 0 and apt == []


def test_the_venv_is_made_only_after_venvdeps(tree):
    r = subprocess.run(["make", "-n", "-B", "demo", f"PYTHON={_debian_python(tree)}"], cwd=tree,
                       capture_output=True, text=True, timeout=30)
    plan = r.stdout
    assert r.returncode == 0, r.stderr
    assert "python3-venv" in plan and plan.index("python3-venv") < plan.index("-m venv .venv"), plan
