"""``kvtier route``'s settings are checked whole (audit s34 a4): a setting of the wrong type is a
``ConfigError`` naming it, never a traceback nor a value taken by its truthiness (D1); one worker
given twice is refused (D2); a worker URL is its base, ``scheme://host:port``, with no path, query,
fragment or credential (D5)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.router.app import Router
from kvtier.router.config import RouterConfig, WorkerSpec
from tests.router.test_http import WordTokenizer

WORKER = '[[worker]]\nurl = "http://127.0.0.1:9"\n'


def _from_file(tmp_path, text: str) -> RouterConfig:
    path = tmp_path / "router.toml"
    path.write_text(text)
    path.chmod(0o600)   # (a file holding a secret setting must be this user's alone)
    return RouterConfig.from_file(path).check()


@pytest.mark.parametrize("name", [f.name for f in fields(RouterConfig)])
def test_every_setting_of_the_wrong_type_is_a_config_error_that_names_it(name):
    """Given as an argument (a program's config) and in a TOML file (a table where a value
    belongs): before, ``policy``, ``shared_events_secret``, ``shared_events_secret_file`` and a
    worker's url crashed with a TypeError, and the text settings were taken as they came."""
    good = [WorkerSpec.parse("http://127.0.0.1:9")]
    with pytest.raises(ConfigError, match=name):
        RouterConfig(**{"workers": good, name: object()}).check()


@pytest.mark.parametrize("name", [f.name for f in fields(RouterConfig)])
def test_every_setting_of_the_wrong_type_in_a_file_is_a_config_error_that_names_it(name, tmp_path):
    with pytest.raises(ConfigError, match=name):
        _from_file(tmp_path, f"{name} = {{ x = 1 }}\n" + WORKER)


@pytest.mark.parametrize("text, says", [
    ('[[worker]]\nurl = 5\n', "each [[worker]] has url"),
    ('[[worker]]\nurl = "http://127.0.0.1:9"\nevents = 5\n', "each [[worker]] has url"),
    ('policy = []\n' + WORKER, "policy must be a string"),
    ('shared_events_secret = 5\n' + WORKER, "shared_events_secret must be a string"),
    ('shared_events_secret_file = 5\n' + WORKER, "shared_events_secret_file must be a string"),
    ('workers = 5\n' + WORKER, "unknown settings ['workers']"),
    ('workers = ["http://127.0.0.1:9"]\n', "unknown settings ['workers']"),
    ('shared_writes = "no"\n' + WORKER, "shared_writes must be true or false, got 'no'"),
    ('shared_writes = 0\n' + WORKER, "shared_writes must be true or false"),
    ('model_path = 5\n' + WORKER, "model_path must be a string"),
    ('worker_api_key = ["k"]\n' + WORKER, "worker_api_key must be a string"),
])
def test_the_audits_wrongly_typed_files_are_refused_by_name(text, says, tmp_path):
    """The audit's cases: a TypeError or AttributeError before, or taken as given
    (``shared_writes = "no"`` read as true, ``model_path = 5``, a top-level ``workers`` list)."""
    with pytest.raises(ConfigError) as caught:
        _from_file(tmp_path, text)
    assert says in str(caught.value), caught.value


def test_well_typed_files_are_taken(tmp_path):
    """Control: the same settings with values of their types."""
    config = _from_file(tmp_path, 'policy = "prefix"\nshared_writes = false\nmodel_path = "m"\nworker_api_key = "k"\n'
                                  + WORKER)
    assert (config.policy, config.shared_writes, config.model_path, config.worker_api_key) == \
        ("prefix", False, "m", "k")
    assert _from_file(tmp_path, "shared_writes = true\n" + WORKER).shared_writes is True


def test_kvtier_route_says_a_wrongly_typed_setting_in_one_line(tmp_path, capsys):
    """Through the command: exit 2 and one ``kvtier route:`` line (before: a traceback, exit 1)."""
    path = tmp_path / "router.toml"
    path.write_text("policy = []\n" + WORKER)
    assert main(["route", "--config", str(path), "--model-path", "m", "--kv-bytes-per-token", "4096"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("kvtier route: ") and "policy must be a string" in err, err


@pytest.mark.parametrize("second", ["http://127.0.0.1:9", "http://127.0.0.1:9/", "HTTP://127.0.0.1:9",
                                    "http://LOCALHOST:9"])
def test_one_worker_given_twice_is_refused(second, tmp_path):
    """Two ``[[worker]]`` entries (or ``--worker`` twice, or both) for one URL, however spelt:
    before, one engine was two workers, routed twice its share, and a drain of its URL marked
    only the first, so the drained engine was still sent requests."""
    first = "http://localhost:9" if "LOCALHOST" in second else "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="given twice"):
        _from_file(tmp_path, f'[[worker]]\nurl = "{first}"\n[[worker]]\nurl = "{second}"\n')
    with pytest.raises(ConfigError, match="given twice"):
        Router(RouterConfig(workers=[WorkerSpec.parse(first), WorkerSpec.parse(second)]), WordTokenizer())
    config = _from_file(tmp_path, f'[[worker]]\nurl = "{first}"\n[[worker]]\nurl = "http://127.0.0.1:10"\n')
    assert [w.url for w in config.workers] == [first, "http://127.0.0.1:10"]           # control


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://h:8000?x=1",
                                 "http://h:8000/?x", "http://h:8000#top", "http://h:8000/#"])
def test_a_worker_url_with_a_path_query_or_fragment_is_refused(url):
    """``http://host:8000/v1``, the OpenAI base URL users copy, had every request sent to
    ``/v1/v1/...`` (vLLM's 404) and the worker ejected by its ``/v1/health`` checks."""
    with pytest.raises(ConfigError, match="scheme://host:port, with no path, query or fragment"):
        WorkerSpec.parse(url)


@pytest.mark.parametrize("url", ["http://admin:secret@127.0.0.1:8000", "http://admin@127.0.0.1:8000",
                                 "http://@127.0.0.1:8000"])
def test_a_worker_url_with_a_credential_is_refused_and_the_key_setting_named(url):
    """A basic-auth password in the URL was shown to every client: X-Kvtier-Worker, the
    unauthenticated GET /health, /metrics labels."""
    with pytest.raises(ConfigError, match="worker_api_key") as caught:
        WorkerSpec.parse(url)
    assert "scheme://host:port" in str(caught.value)


@pytest.mark.parametrize("url, named", [("HTTP://LocalHost:8000/", "http://localhost:8000"),
                                        ("https://Worker-1.Example", "https://worker-1.example"),
                                        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
                                        ("http://[::1]:8000/", "http://[::1]:8000")])
def test_a_worker_url_is_named_in_lower_case_without_its_slash(url, named):
    assert WorkerSpec.parse(url).url == named
    assert WorkerSpec.parse(url + ",events=tcp://127.0.0.1:5557").url == named
