"""A server config file that holds the KV-events secrets must be private, as the key files are.

``events_curve_secret`` (the server's CURVE key: whoever holds it poses as the server to every
router) and ``events_name_key`` (names every tenant's blocks in the events) were read from a
config file of any mode, while ``master_key_file``, ``mooncake_secret_file`` and ``tls_key`` are
refused unless 0600 and this user's. Now a file holding either is refused when others may read
it or another user owns it, with an error naming the file and the fix; the environment
(``KVTIER_SERVE_EVENTS_*``) stays the other way to give them.
"""

from __future__ import annotations

import os

import pytest
import zmq

from kvtier.errors import ConfigError
from kvtier.server.auth import hash_token
from kvtier.server.config import load_config

_PUBLIC, _SECRET = (k.decode() for k in zmq.curve_keypair())
NAME_KEY = "ab" * 32
TENANT = f'[[tenant]]\nname = "acme"\ntoken_sha256 = ["{hash_token("acme")}"]\n'
EVENTS = f'events = "tcp://127.0.0.1:7401"\nevents_subscribers = ["{_PUBLIC}=*"]\n'


def _write(tmp_path, secrets: str, mode: int):
    path = tmp_path / "kvtier.toml"
    path.write_text(f'[server]\nlisten = ["tcp://127.0.0.1:7070"]\n{EVENTS}{secrets}{TENANT}')
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_config_file_others_may_read_with_events_secrets_is_refused(tmp_path, mode):
    path = _write(tmp_path, f'events_curve_secret = "{_SECRET}"\nevents_name_key = "{NAME_KEY}"\n', mode)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    message = str(err.value)
    for part in (str(path), "events_curve_secret", "events_name_key", f"chmod 600 {path}", f"{mode:04o}",
                 "KVTIER_SERVE_EVENTS_CURVE_SECRET"):
        assert part in message, (part, message)


def test_one_secret_is_enough_to_need_a_private_file(tmp_path):
    path = _write(tmp_path, f'events_name_key = "{NAME_KEY}"\n', 0o644)
    with pytest.raises(ConfigError, match="events_name_key"):
        load_config(path, env={"KVTIER_SERVE_EVENTS_CURVE_SECRET": _SECRET})


def test_a_private_config_file_with_the_secrets_is_taken(tmp_path):
    path = _write(tmp_path, f'events_curve_secret = "{_SECRET}"\nevents_name_key = "{NAME_KEY}"\n', 0o600)
    c = load_config(path, env={})
    assert c.events_curve_secret == _SECRET and c.events_name_key == NAME_KEY


def test_a_readable_config_file_without_secrets_is_taken(tmp_path):
    """The secrets from the environment, the rest from a 0644 file (hashes of tokens are no secret)."""
    path = _write(tmp_path, "", 0o644)
    c = load_config(path, env={"KVTIER_SERVE_EVENTS_CURVE_SECRET": _SECRET, "KVTIER_SERVE_EVENTS_NAME_KEY": NAME_KEY})
    assert c.events_curve_secret == _SECRET and c.events_name_key == NAME_KEY


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_config_file_of_another_user_with_secrets_is_refused(tmp_path):
    path = _write(tmp_path, f'events_curve_secret = "{_SECRET}"\nevents_name_key = "{NAME_KEY}"\n', 0o600)
    os.chown(path, 65534, 65534)   # nobody: it could rewrite the file, secrets and all
    with pytest.raises(ConfigError, match="another user owns it"):
        load_config(path, env={})
