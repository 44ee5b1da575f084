"""RemoteTier against a server that breaks the protocol's promises, and the client's own inputs.

A misbehaving server -- another version's, a broken one, a man in the middle without TLS -- is a
miss, a ``False`` or a ``0``, never an exception to the caller (:mod:`kvtier.tiers.remote`). The
server is :mod:`tests.tiers.hostile_server`; each hostile case has a positive control against its
healthy mode, so a test cannot pass because the client never worked at all.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from kvtier.core.keys import as_token_array, block_keys
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.errors import ConfigError
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import Op, pack_msgpack
from kvtier.tiers.remote_wire import WireClient, _remaining, parse_url
from tests.tiers.hostile_server import GOOD_HELLO, HostileServer, answering, payload_for, reply

KEYS = [hashlib.sha256(b"hostile/%d" % i).digest() for i in range(4)]
NBYTES = 4096


def _tier(srv: HostileServer, **kw) -> RemoteTier:
    kw = {"timeout_s": 1.0, "connect_timeout_s": 1.0, "backoff_s": 0.01, "max_backoff_s": 0.01, **kw}
    return RemoteTier(srv.url, "t", **kw)


def _get_all(tier: RemoteTier) -> list[Status]:
    outs = [np.zeros(NBYTES, np.uint8) for _ in KEYS]
    statuses = tier.get_many(KEYS, outs)
    for s, k, o in zip(statuses, KEYS, outs):
        assert s is not Status.OK or o.tobytes() == payload_for(k, NBYTES)
    return statuses


# -- D1: the HELLO reply's fields are checked once, when the connection is set up ---------------
BAD_HELLOS = {
    "features-int": {"features": 1},
    "features-str": {"features": "sealed list_cursor"},  # iterable, but not a list of features
    "features-map": {"features": {"sealed": True}},
    "max_block-str": {"max_block": "8MiB"},
    "max_block-negative": {"max_block": -1},
    "max_block-float": {"max_block": 1.5},
    "max_block-bool": {"max_block": True},
    "idle-str": {"idle_timeout_s": "5m"},
    "idle-nan": {"idle_timeout_s": float("nan")},
    "idle-inf": {"idle_timeout_s": float("inf")},
    "idle-negative": {"idle_timeout_s": -3},
}


def test_a_good_hello_is_read_as_sent():
    with HostileServer() as srv:
        conn = WireClient(parse_url(srv.url), "t", connect_timeout_s=1.0)
        try:
            assert conn.features == frozenset(GOOD_HELLO["features"])
            assert (conn.max_block, conn.idle_timeout_s) == (8 << 20, 300.0)
        finally:
            conn.close()
        tier = _tier(srv)
        assert tier.streams_available() and tier.ping()


@pytest.mark.parametrize("fields", BAD_HELLOS.values(), ids=BAD_HELLOS.keys())
def test_hello_fields_of_the_wrong_type_are_defaults_and_the_tier_works(fields):
    with HostileServer(hello={**GOOD_HELLO, **fields}) as srv:
        tier = _tier(srv)
        assert tier.ping(), tier.last_error
        assert _get_all(tier) == [Status.OK] * len(KEYS)
        assert tier.put(KEYS[0], np.ones(NBYTES, np.uint8)) is Status.OK
        assert tier.stats.errors == 0
        assert srv.connections == 1  # reused, not redone (an idle timeout < 0 would be "expired")
        conn = WireClient(parse_url(srv.url), "t", connect_timeout_s=1.0)
        try:
            assert isinstance(conn.features, frozenset) and all(isinstance(f, str) for f in conn.features)
            assert type(conn.max_block) is int and conn.max_block >= 0
            assert type(conn.idle_timeout_s) is float and 0 <= conn.idle_timeout_s < float("inf")
            assert conn.reusable()
        finally:
            conn.close()


def test_features_keep_only_names():
    with HostileServer(hello={**GOOD_HELLO, "features": [1, None, "sealed", ["list_cursor"]]}) as srv:
        conn = WireClient(parse_url(srv.url), "t", connect_timeout_s=1.0)
        conn.close()
        assert conn.features == {"sealed"}
        assert _tier(srv).streams_available()


@pytest.mark.parametrize("features", [1, "sealed"], ids=["int", "str"])
def test_streams_available_is_false_for_features_that_are_no_list(features):
    with HostileServer(hello={**GOOD_HELLO, "features": features}) as srv:
        assert _tier(srv).streams_available() is False


def test_keys_is_empty_for_features_that_are_no_list():
    with HostileServer(hello={**GOOD_HELLO, "features": 1}) as srv:
        assert list(_tier(srv).keys()) == []


def test_a_store_get_through_an_encrypted_remote_tier_of_odd_features_is_a_miss(tmp_path):
    with HostileServer(hello={**GOOD_HELLO, "features": 1}) as srv:
        keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
        store = TieredStore([HostTier(1 << 20, 8192, prefault=False),
                             EncryptedTier(_tier(srv), keyring, "t", threads=1)])
        try:
            result = store.get(KEYS, [np.zeros(NBYTES, np.uint8) for _ in KEYS])
            assert all(s is not Status.OK for s in result.statuses)
        finally:
            store.close(flush_timeout_s=0)


# -- D2 (and S1's neighbour): a bad LIST reply is a failure of the server, not the caller's -----
def _listing(pages: dict[int, tuple[int, list[bytes]]]):
    """LIST answered from ``pages``: cursor -> (next cursor, keys)."""
    def fn(h, meta):
        cursor = int.from_bytes(meta[:8], "little")
        nxt, keys = pages.get(cursor, (0, []))
        return reply(h, nxt.to_bytes(8, "little") + b"".join(keys))
    return answering(Op.LIST, fn)


def test_keys_follow_the_cursor_of_a_healthy_server():
    with HostileServer(_listing({0: (7, KEYS[:2]), 7: (9, KEYS[2:3]), 9: (0, KEYS[3:])})) as srv:
        tier = _tier(srv)
        assert list(tier.keys()) == KEYS
        assert tier.stats.errors == 0


@pytest.mark.parametrize("body", [
    (5).to_bytes(8, "little") + b"x" * 5,  # a cursor, then 5 bytes: no whole key
    (1).to_bytes(8, "little") + KEYS[0],  # then cursor 1 again, forever: it does not advance
], ids=["partial-key", "cursor-stuck"])
def test_keys_with_a_malformed_list_reply_is_a_failure_not_an_exception(body):
    with HostileServer(answering(Op.LIST, lambda h, meta: reply(h, body))) as srv:
        tier = _tier(srv, backoff_s=5.0, max_backoff_s=5.0)
        got = list(tier.keys())
        assert len(got) <= 1
        assert tier.stats.errors == 1 and not tier.available  # counted, and in backoff
        assert "LIST" in tier.last_error


# -- D3: a deadline is a finite number of seconds --------------------------------------------------
@pytest.mark.parametrize("kw", [
    {"timeout_s": float("nan")}, {"timeout_s": float("inf")}, {"timeout_s": True}, {"timeout_s": "5"},
    {"connect_timeout_s": float("nan")}, {"connect_timeout_s": -1.0}, {"connect_timeout_s": 0},
    {"connect_timeout_s": float("inf")},
    {"min_rate_bytes_s": float("nan")}, {"min_rate_bytes_s": float("inf")},
], ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))!r}")
def test_a_deadline_that_is_no_finite_positive_number_is_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        RemoteTier("tcp://127.0.0.1:1", "t", **kw)


def test_a_huge_timeout_works_against_a_healthy_server():
    with HostileServer() as srv:
        tier = _tier(srv, timeout_s=1e20, connect_timeout_s=1e20, min_rate_bytes_s=1e-300)
        assert tier.ping(), tier.last_error
        assert _get_all(tier) == [Status.OK] * len(KEYS)


def test_the_time_left_is_clamped_and_a_nan_deadline_fails_closed():
    assert 0 < _remaining(time.monotonic() + 1e20) <= 86400.0
    assert _remaining(time.monotonic() + 1.0) <= 1.0
    with pytest.raises(TimeoutError):
        _remaining(float("nan"))
    with pytest.raises(TimeoutError):
        _remaining(time.monotonic() - 1.0)


# -- D4: STATS values the client cannot use are 0 ---------------------------------------------
def _stats(stats: dict):
    return answering(Op.STATS, lambda h, meta: reply(h, pack_msgpack(stats)))


def test_stats_of_a_healthy_server_are_read():
    with HostileServer(_stats({"quota_bytes": 0, "capacity_bytes": 1 << 20, "namespace_bytes": 4096})) as srv:
        tier = _tier(srv)
        assert (tier.capacity_bytes, tier.used_bytes) == (1 << 20, 4096)


@pytest.mark.parametrize("value", ["lots", [1], float("nan"), float("inf"), 1.5, True, -5],
                         ids=["str", "list", "nan", "inf", "float", "bool", "negative"])
def test_odd_stats_values_are_zero_not_exceptions(value):
    with HostileServer(_stats({"quota_bytes": value, "capacity_bytes": value, "namespace_bytes": value})) as srv:
        tier = _tier(srv)
        assert (tier.capacity_bytes, tier.used_bytes) == (0, 0)


def test_an_odd_quota_falls_back_to_the_capacity():
    with HostileServer(_stats({"quota_bytes": "lots", "capacity_bytes": 1 << 20})) as srv:
        assert _tier(srv).capacity_bytes == 1 << 20


def test_store_stats_survive_a_remote_tier_with_odd_stats():
    with HostileServer(_stats({"quota_bytes": "lots", "namespace_bytes": "some"})) as srv:
        store = TieredStore([HostTier(1 << 20, 8192, prefault=False), _tier(srv)])
        try:
            assert "remote" in store.stats()["tiers"]
        finally:
            store.close(flush_timeout_s=0)


# -- D5: a URL error names the mistake, never the token ------------------------------------------
SECRET = "s3cr3t-token-value"


@pytest.mark.parametrize("url, names", [
    (f"tcp://127.0.0.1:7070?token={SECRET}&namspace=llama", "namspace"),  # a misspelt parameter
    (f"tcp://127.0.0.1:7070?tokn={SECRET}", "tokn"),  # the token's own name misspelt
    (f"tcp://127.0.0.1?token={SECRET}", "127.0.0.1"),  # the port forgotten
    (f"tcp://127.0.0.1:70x0?token={SECRET}", "70x0"),  # a bad port
    (f"tpc://127.0.0.1:7070?namespace=llama&token={SECRET}", "namespace=llama"),  # a misspelt scheme
    (f"tcp://user:{SECRET}@127.0.0.1?ca=ca.pem", "ca=ca.pem"),  # a password in the user info
    (f"unix:kvtier.sock?token={SECRET}", "unix:kvtier.sock"),  # a relative socket path
], ids=["unknown-param", "misspelt-token", "no-port", "bad-port", "bad-scheme", "userinfo", "unix-relative"])
def test_a_url_error_names_the_mistake_not_the_token(url, names):
    with pytest.raises(ConfigError) as err:
        parse_url(url)
    assert SECRET not in str(err.value)
    assert names in str(err.value)


# -- D6: token ids are integers ---------------------------------------------------------------------
@pytest.fixture
def ns() -> Namespace:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
    return Namespace(model_id="test/tiny", layout=layout, weights_revision="r1", tenant="t0")


@pytest.mark.parametrize("tokens", [
    np.arange(32) + 0.5, np.arange(32, dtype=np.float32), np.full(32, np.nan), np.ones(32, bool),
], ids=["float-halves", "float-whole", "nan", "bool"])
def test_a_token_array_that_is_not_integers_is_refused(ns, tokens):
    with pytest.raises(ValueError, match="integers"):
        block_keys(ns, tokens)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint32, ">u4"])
def test_integer_token_arrays_key_like_a_list(ns, dtype):
    ints = list(range(40))
    assert block_keys(ns, np.array(ints, dtype=dtype)) == block_keys(ns, ints)


def test_an_empty_array_of_any_dtype_is_no_tokens():
    assert as_token_array(np.array([])).size == 0
