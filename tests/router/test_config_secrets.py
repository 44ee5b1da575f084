"""The router's secrets stay off the command line and out of files others may read.

``--shared-events-secret`` put the router's CURVE secret (its public key follows from it, and the
server admits that key, usually for every tenant's events) in ``/proc/PID/cmdline``, which every
local user reads; there was no other way to give it but a config file, read whatever its mode
(``worker_api_key`` too). Now the flag is refused with an error naming the ways that remain:
``$KVTIER_ROUTER_EVENTS_SECRET`` or ``--shared-events-secret-file`` (``shared_events_secret_file``
in the config), a 0600 file read with ``read_private_file``; and a config file holding a secret is
refused unless 0600 and this user's, as the server's key files are.
"""

from __future__ import annotations

import argparse
import os

import pytest
import zmq

from kvtier.cli import route
from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig

PUBLIC, SECRET = (k.decode() for k in zmq.curve_keypair())
EVENTS = ["--shared-events", "tcp://10.0.0.5:7401", "--shared-events-server-public", PUBLIC,
          "--shared-events-public", PUBLIC]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    route.register(parser.add_subparsers())
    return parser


def _config(*argv: str) -> RouterConfig:
    return route.build_config(_parser().parse_args(["route", "--worker", "http://127.0.0.1:1", *EVENTS, *argv]))


def _secret_file(tmp_path, mode: int = 0o600, text: str = SECRET + "\n"):
    path = tmp_path / "router.secret"
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.fixture(autouse=True)
def _no_secret_env(monkeypatch):
    monkeypatch.delenv("KVTIER_ROUTER_EVENTS_SECRET", raising=False)
    monkeypatch.delenv("KVTIER_WORKER_API_KEY", raising=False)


def test_the_secret_on_the_command_line_is_refused_naming_the_alternatives(capsys):
    for argv in (["--shared-events-secret", SECRET], [f"--shared-events-secret={SECRET}"]):
        with pytest.raises(SystemExit) as exit_:
            _parser().parse_args(["route", "--worker", "http://127.0.0.1:1", *EVENTS, *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "KVTIER_ROUTER_EVENTS_SECRET" in err and "--shared-events-secret-file" in err, err
        assert "command line" in err


def test_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_ROUTER_EVENTS_SECRET", SECRET)
    assert _config().shared_events_secret == SECRET


def test_the_secret_from_a_private_file_and_the_flag_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_ROUTER_EVENTS_SECRET", "x" * 40)
    config = _config("--shared-events-secret-file", str(_secret_file(tmp_path)))
    assert config.shared_events_secret == SECRET
    assert config.check().shared_events_secret == SECRET   # Router() checks it again


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_secret_file_others_may_read_is_refused(tmp_path, mode):
    path = _secret_file(tmp_path, mode)
    with pytest.raises(ConfigError, match=f"chmod 600 {path}.*KVTIER_ROUTER_EVENTS_SECRET"):
        _config("--shared-events-secret-file", str(path))


def test_a_secret_file_that_is_no_secret_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="40-character z85"):
        _config("--shared-events-secret-file", str(_secret_file(tmp_path, text="not a curve secret")))


def _toml(tmp_path, extra: str, mode: int):
    path = tmp_path / "router.toml"
    path.write_text(f'shared_events = "tcp://10.0.0.5:7401"\nshared_events_server_public = "{PUBLIC}"\n'
                    f'shared_events_public = "{PUBLIC}"\n{extra}[[worker]]\nurl = "http://127.0.0.1:1"\n')
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("secret", ["shared_events_secret", "worker_api_key"])
def test_a_config_file_others_may_read_with_a_secret_is_refused(tmp_path, secret):
    value = SECRET if secret == "shared_events_secret" else "sk-worker"
    path = _toml(tmp_path, f'{secret} = "{value}"\n', 0o644)
    with pytest.raises(ConfigError) as err:
        RouterConfig.from_file(path)
    for part in (str(path), secret, f"chmod 600 {path}", "0644"):
        assert part in str(err.value), (part, str(err.value))
    # control: the same file, private, is taken
    os.chmod(path, 0o600)
    assert getattr(RouterConfig.from_file(path).check(), secret) == value


def test_a_config_file_without_secrets_may_be_readable_and_names_its_secret_file_beside_it(tmp_path):
    _secret_file(tmp_path)
    path = _toml(tmp_path, 'shared_events_secret_file = "router.secret"\n', 0o644)
    config = route.build_config(_parser().parse_args(["route", "--config", str(path)]))
    assert config.shared_events_secret == SECRET


def test_a_config_file_with_both_the_secret_and_its_file_is_refused(tmp_path):
    _secret_file(tmp_path)
    path = _toml(tmp_path, f'shared_events_secret = "{SECRET}"\nshared_events_secret_file = "router.secret"\n', 0o600)
    with pytest.raises(ConfigError, match="give one"):
        RouterConfig.from_file(path).check()


def test_a_router_takes_the_secret_from_its_file(tmp_path):
    """``Router`` checks its config again: the secret read from the file is kept, not refused as
    given twice."""
    from kvtier.router.app import Router
    from tests.router.test_http import WordTokenizer

    config = _config("--shared-events-secret-file", str(_secret_file(tmp_path)), "--kv-bytes-per-token", "4096")
    assert Router(config, WordTokenizer()).config.shared_events_secret == SECRET
