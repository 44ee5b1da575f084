import numpy as np
import pytest

from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.errors import ConfigError
from kvtier.store.config import StoreConfig, build_store, parse_bytes
from kvtier.store.context import ContextCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def test_sizes_parse_and_bad_ones_name_the_fix():
    assert parse_bytes("8GiB", "x") == 8 << 30
    assert parse_bytes("500 GB", "x") == 500 * 10**9
    with pytest.raises(ConfigError, match="write e.g. 8GiB"):
        parse_bytes("lots", "host_bytes")


def test_unknown_settings_are_rejected_with_the_known_list():
    with pytest.raises(ConfigError, match="known settings are"):
        StoreConfig.from_dict({"hostbytes": "1GiB"})


def test_encryption_turns_on_when_a_master_key_is_configured(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_MASTER_KEY", "11" * 32)
    config = StoreConfig(host_bytes=8 * LAYOUT.block_nbytes, disk_path=str(tmp_path / "d"), tenant="acme")
    store = build_store(config, LAYOUT)
    assert [t.name for t in store.tiers] == ["host", "encrypted(disk)"]
    cache = ContextCache(store, Namespace("m", LAYOUT, tenant="acme"))
    tokens = np.arange(20 * LAYOUT.block_tokens)
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(LAYOUT.block_shape).astype(np.float16) for _ in range(20)]
    cache.save(cache.keys(tokens), blocks)  # 12 blocks demoted into the encrypted disk tier
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "d").rglob("*.kvb"))
    assert on_disk and blocks[0].tobytes()[:256] not in on_disk
    outs = [np.empty(LAYOUT.block_shape, np.float16) for _ in range(20)]
    assert cache.load(cache.keys(tokens), outs).loaded == 20
    assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
    store.close()


def test_encrypt_true_without_a_key_names_the_fix(monkeypatch):
    monkeypatch.delenv("KVTIER_MASTER_KEY", raising=False)
    with pytest.raises(ConfigError, match="KVTIER_MASTER_KEY"):
        build_store(StoreConfig(encrypt=True), LAYOUT)


def test_write_behind_settings_are_validated_and_reach_the_store(tmp_path):
    assert StoreConfig().write_mode == "write-behind"
    for bad in ({"write_mode": "write-around"}, {"dirty_limit_blocks": 0}, {"dirty_limit_blocks": "many"},
                {"close_flush_timeout_s": -1}, {"close_flush_timeout_s": "soon"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            StoreConfig(**bad)
    config = StoreConfig(host_bytes=8 * LAYOUT.block_nbytes, disk_path=str(tmp_path / "d"), write_mode="write-back",
                         dirty_limit_blocks=7, close_flush_timeout_s=1.5, encrypt=False)
    store = build_store(config, LAYOUT)
    assert store.write_mode.value == "write-behind"  # the old name, same mode
    assert store.close_flush_timeout_s == 1.5
    assert store._writebehind.dirty_limit == 7
    store.close()
    store = build_store(config.replace(write_mode="write-through", close_flush_timeout_s=None), LAYOUT)
    assert store.write_mode.value == "write-through" and store.close_flush_timeout_s is None
    assert store.close() == (0, 0, 0.0)


@pytest.mark.parametrize("setting", [
    {"async_load": "false"},            # a string: Python reads it as true
    {"pd_wait_s": float("nan")},         # passes `< 0`, and then no wait ever ends as meant
    {"pd_wait_s": "5"},
    {"shutdown_flush_s": float("inf")},
    {"remote_timeout_s": 0},
    {"mooncake_timeout_s": float("nan")},
    {"mooncake_timeout_s": 1e10},       # finite, "never give up": the fleet tier's start raised OverflowError
    {"remote_timeout_s": 86400.5},
    {"pd_wait_s": 1e10},
    {"close_flush_timeout_s": 1e10},    # close() with dirty blocks raised OverflowError
    {"mooncake_replicas": 0},
    {"mooncake_replicas": True},
    {"encrypt_host": "yes"},
    {"disk_path": 5},
    {"debug_poison": 1},
])
def test_connector_and_store_settings_of_the_wrong_kind_are_refused_by_name(setting):
    from kvtier.integrations.vllm.config import ConnectorConfig

    name = next(iter(setting))
    with pytest.raises(ConfigError, match=name):
        ConnectorConfig.from_extra_config({"block_tokens": 256, **setting})


def test_good_settings_of_each_kind_pass(tmp_path):
    from pathlib import Path

    from kvtier.integrations.vllm.config import ConnectorConfig

    config = ConnectorConfig.from_extra_config({
        "block_tokens": 256, "async_load": False, "pd_wait_s": 0, "shutdown_flush_s": 2.5, "remote_timeout_s": 1,
        "mooncake_replicas": 2, "encrypt_host": False, "disk_path": str(tmp_path), "debug_poison": None})
    assert (config.async_load, config.pd_wait_s, config.store.mooncake_replicas) == (False, 0, 2)
    assert StoreConfig(disk_path=Path(tmp_path)).disk_path == str(tmp_path)   # a Path from Python callers


def test_seconds_settings_up_to_a_day_pass():
    from kvtier.store.config import MAX_SECONDS

    assert MAX_SECONDS == 86400
    config = StoreConfig(remote_timeout_s=MAX_SECONDS, mooncake_timeout_s=MAX_SECONDS,
                         close_flush_timeout_s=MAX_SECONDS)
    assert (config.remote_timeout_s, config.mooncake_timeout_s, config.close_flush_timeout_s) == (86400,) * 3
    with pytest.raises(ConfigError, match=r"mooncake_timeout_s=10000000000.0; give seconds > 0 and at most 86400"):
        StoreConfig(mooncake_timeout_s=1e10)


def test_a_mooncake_secret_file_others_can_read_is_refused(tmp_path, monkeypatch):
    import kvtier.tiers.mooncake as mc
    from kvtier.store.config import _mooncake_tier

    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    made = []
    monkeypatch.setattr(mc, "MooncakeTier", lambda *a, **k: made.append(k) or object())
    config = StoreConfig(host_bytes=0, mooncake_master="127.0.0.1:1", mooncake_secret_file=str(secret))
    for mode in (0o644, 0o640, 0o604, 0o620):
        secret.chmod(mode)
        with pytest.raises(ConfigError, match="chmod 600"):
            _mooncake_tier(config, None)
    link = tmp_path / "link.secret"
    link.symlink_to(secret)
    secret.chmod(0o600)
    with pytest.raises(ConfigError, match="cannot read"):   # a symlink is not followed
        _mooncake_tier(config.replace(mooncake_secret_file=str(link)), None)
    assert not made
    _mooncake_tier(config, None)                             # control: a 0600 file is used
    assert made and made[0]["secret"] == b"0123456789abcdef0123456789abcdef"


def _sealed_store_with_blocks_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_MASTER_KEY", "22" * 32)
    config = StoreConfig(host_bytes=4 * LAYOUT.block_nbytes, disk_path=str(tmp_path / "d"), tenant="acme",
                         write_mode="write-through")
    store = build_store(config, LAYOUT)
    cache = ContextCache(store, Namespace("m", LAYOUT, tenant="acme"))
    tokens = np.arange(6 * LAYOUT.block_tokens)
    blocks = [np.full(LAYOUT.block_shape, i, np.float16) for i in range(6)]
    cache.save(cache.keys(tokens), blocks)
    store.close()
    return config, tokens, blocks


def test_a_missing_key_store_is_refused_when_the_disk_holds_blocks(tmp_path, monkeypatch):
    """A key store not mounted (or a typo in keystore_dir) must not be replaced by new keys, under
    which every sealed block on disk would be a miss for good: the start is refused, nothing lost."""
    import shutil

    config, tokens, blocks = _sealed_store_with_blocks_on_disk(tmp_path, monkeypatch)
    files = sorted(p.name for p in (tmp_path / "d").rglob("*.kvb"))
    assert files
    shutil.move(tmp_path / "d" / "keys", tmp_path / "keys-elsewhere")
    with pytest.raises(ConfigError, match="key store .* is missing, but .* holds 6 block files"):
        build_store(config, LAYOUT)
    assert not (tmp_path / "d" / "keys").exists(), "no new key store was made"
    assert sorted(p.name for p in (tmp_path / "d").rglob("*.kvb")) == files
    # Control: the key store back in place, every block loads again.
    shutil.move(tmp_path / "keys-elsewhere", tmp_path / "d" / "keys")
    store = build_store(config, LAYOUT)
    cache = ContextCache(store, Namespace("m", LAYOUT, tenant="acme"))
    outs = [np.full(LAYOUT.block_shape, -1, np.float16) for _ in blocks]
    assert cache.load(cache.keys(tokens), outs).loaded == 6
    assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
    store.close()



# -- audit s27 (vLLM edges, second pass) V2: values checked when the config is read ----------------
@pytest.mark.parametrize("policy", ["lfu", "LRU", "", 3, None])
def test_an_unknown_eviction_policy_is_refused_when_the_config_is_read(policy):
    """It was a ValueError from ``build_store``, in an engine's worker after its model loaded."""
    with pytest.raises(ConfigError, match="eviction=.*choose one of \\['lru', 'prefix-lru'\\]"):
        StoreConfig(eviction=policy)


def test_the_policy_factory_refuses_with_a_config_error_too():
    from kvtier.policy.eviction import POLICIES, make_policy

    with pytest.raises(ConfigError, match="eviction='lfu'"):
        make_policy("lfu")
    for name in POLICIES:      # control: every policy there is passes, in the config and the factory
        assert StoreConfig(eviction=name).eviction == name
        assert make_policy(name).name == name


@pytest.mark.parametrize("url", ["tcp://kv-0", "http://kv-0:7400", "tcp://:7400", "unix:run/kvtier.sock",
                                 "tcp://kv-0:7400?tokn=abc"])
def test_a_remote_url_that_cannot_be_opened_is_refused_when_the_config_is_read(url):
    with pytest.raises(ConfigError, match="remote_url"):
        StoreConfig(remote_url=url)


def test_a_refused_remote_url_never_shows_its_token():
    for url in ("tcp://kv-0/ns?token=s3cret-t0ken", "tcp://user:s3cret-t0ken@kv-0", "bogus://h:1?token=s3cret-t0ken"):
        with pytest.raises(ConfigError) as err:
            StoreConfig(remote_url=url)
        assert "s3cret-t0ken" not in str(err.value), err.value


def test_good_remote_urls_still_pass():
    for url in ("tcp://kv-0:7400", "tls://kv-0:7400?ca=/etc/ca.pem", "unix:///run/kvtier.sock",
                "tcp://127.0.0.1:7400/?namespace=a&token=t"):
        assert StoreConfig(remote_url=url).remote_url == url


@pytest.mark.parametrize("token", [12345678, 1.5, True, ["s3cret"]])
def test_a_remote_token_that_is_no_string_is_refused_without_its_value(token):
    """An unquoted numeric token in a YAML config is still the secret: the message names its type."""
    with pytest.raises(ConfigError, match="remote_token: give a string") as err:
        StoreConfig(remote_token=token)
    assert str(token) not in str(err.value) and "s3cret" not in str(err.value)
