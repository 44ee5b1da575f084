"""``kvtier demo --remote URL --store-dir DIR``: refused, not run without DIR (audit s31 a5 D4).

With ``--remote`` the engines' store is the server alone (no disk tier): ``--store-dir`` was
neither checked (a path that cannot exist passed) nor used, and the run exited 0 as if a disk
tier had been there. A real server answers the preflight; the engine runs are replaced by a
tripwire that records whether they were reached."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from kvtier.demo import runner
from kvtier.server.launch import ServerProcess

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("torch", "transformers", "tokenizers")),
    reason="kvtier demo refuses to start without torch, transformers and tokenizers")

TOKEN = "demo-token-" + "7" * 20


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with ServerProcess.start({"demo": TOKEN}, workdir=str(tmp_path_factory.mktemp("srv"))) as srv:
        yield srv.tcp_url


@pytest.fixture
def replays(tmp_path, monkeypatch):
    """The store directories the engine runs were asked to use (none is run)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVTIER_TOKEN", TOKEN)
    asked = []

    def tripwire(scenario, store_dir, reporter, **kw):
        asked.append(store_dir)
        raise RuntimeError("the engine runs were reached")

    monkeypatch.setattr(runner, "replay", tripwire)
    return asked


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(quick=True, json=True, plot=None, synthetic=False, store_dir=None, remote=None,
                                        threads=None), **kw})


@pytest.mark.parametrize("store_dir", ["/nonexistent/kvtier-store", "{tmp}/store"])
def test_store_dir_with_remote_is_refused_before_the_runs(server_url, replays, tmp_path, capsys, store_dir):
    rc = runner.run_demo(_args(remote=server_url, store_dir=store_dir.format(tmp=tmp_path)))
    err = capsys.readouterr().err
    assert rc == 2 and replays == [], err
    assert "--store-dir is the local disk tier's; --remote uses the server" in err, err
    assert not (tmp_path / "store").exists()


def test_control_remote_alone_reaches_the_runs(server_url, replays):
    """The same server passes the preflight: the refusal above is --store-dir's, not the server's."""
    with pytest.raises(RuntimeError, match="the engine runs were reached"):
        runner.run_demo(_args(remote=server_url))
    assert len(replays) == 1
