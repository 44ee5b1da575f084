"""StoreConfig: one validated description of a store, from code, a dict or the environment.

Engines (the vLLM connector, the transformers integration, the demo) build
their store from this, so the same keys mean the same thing everywhere::

    {"host_bytes": "8GiB", "disk_path": "/mnt/nvme/kvtier", "disk_bytes": "500GiB",
     "remote_url": "tcp://pod-kv:7400", "remote_token": "...", "encrypt": "auto"}

Encryption is on for the disk and remote tiers whenever a master key is
configured (``master_key_file`` or ``$KVTIER_MASTER_KEY``) and ``encrypt`` is
"auto"; the host tier stays plaintext unless ``encrypt_host`` is set. A disk
or remote tier without encryption, and the default tenant ``""``, are allowed
but logged at WARNING once per process (:mod:`kvtier.store.safety`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from kvtier.core.layout import KVLayout
from kvtier.core.namespace import check_namespace
from kvtier.core.units import parse_size
from kvtier.errors import ConfigError
from kvtier.policy.eviction import check_policy_name
from kvtier.private_files import read_private_file

#: ``8GiB``, ``500 GB``, ``1048576`` → bytes: the one size parser (units defined there)
parse_bytes = parse_size


#: the longest duration a setting may give: a day. Python's waits refuse more than
#: ``threading.TIMEOUT_MAX`` (~9.2e9 s: "never give up" written as 1e10 crashed the fleet tier's
#: start with OverflowError), and no timeout or wait of a store means more than a day.
MAX_SECONDS = 86400


def check_seconds(value, name: str, *, positive: bool = False, hint: str = "") -> None:
    """A duration setting: a finite number of seconds, >= 0 (> 0 if ``positive``), at most
    :data:`MAX_SECONDS`. A JSON or TOML config can hold a string, a boolean or NaN, which pass a
    bare ``< 0`` check or break it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0) or value > MAX_SECONDS:
        raise ConfigError(f"{name}={value!r}; give seconds {'> 0' if positive else '>= 0'} and at most "
                          f"{MAX_SECONDS} (a day){hint}")


def check_flag(value, name: str, *, optional: bool = False) -> None:
    """A boolean setting: true or false, not the string "false" (which Python reads as true)."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise ConfigError(f"{name}={value!r}; use true or false")


def check_text(value, name: str, *, optional: bool, empty: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{name}={value!r}; give a {'non-empty ' if not empty else ''}string")


@dataclass(frozen=True)
class StoreConfig:
    host_bytes: int | str = "1GiB"
    disk_path: str | None = None
    disk_bytes: int | str = "10GiB"
    remote_url: str | None = None
    remote_token: str | None = None  # default: $KVTIER_TOKEN
    remote_namespace: str | None = None  # the server-side key space (default: from the URL)
    remote_timeout_s: float = 2.0
    mooncake_master: str | None = None  # a Mooncake Store fleet below the rest: the master's RPC host:port
    mooncake_metadata: str = "P2PHANDSHAKE"  # its metadata server URL (http://host:port/metadata)
    mooncake_hostname: str = "127.0.0.1"  # the address other nodes reach this process at
    mooncake_replicas: int = 1
    mooncake_timeout_s: float = 2.0
    mooncake_secret_file: str | None = None  # names/tags key; default: derived from the master key
    write_mode: str = "write-behind"  # "write-back" is its old name; or "write-through"
    dirty_limit_blocks: int = 16384  # write-behind backlog per tier; one more drops the oldest mark
    close_flush_timeout_s: float | None = 30.0  # close() copies dirty blocks down for at most this
    eviction: str = "lru"
    tenant: str = ""
    encrypt: str | bool = "auto"  # "auto": when a master key is configured
    encrypt_host: bool = False
    master_key_file: str | None = None
    keystore_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("disk_path", "mooncake_secret_file", "master_key_file", "keystore_dir"):
            if isinstance(getattr(self, name), os.PathLike):   # a pathlib.Path from Python callers
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("disk_path", "remote_url", "remote_namespace", "mooncake_master",
                     "mooncake_secret_file", "master_key_file", "keystore_dir"):
            check_text(getattr(self, name), name, optional=True)
        if self.remote_token is not None and not isinstance(self.remote_token, str):
            # never its value: an unquoted numeric token in a YAML file is still the secret
            raise ConfigError(f"remote_token: give a string (quoted in YAML), not a "
                              f"{type(self.remote_token).__name__}")
        for name in ("mooncake_metadata", "mooncake_hostname", "tenant"):
            check_text(getattr(self, name), name, optional=False, empty=name == "tenant")
        # Checked here, not when the tiers open: an engine reads this before loading its model.
        check_policy_name(self.eviction)
        if self.remote_url:
            from kvtier.tiers.remote_wire import parse_url

            try:
                address = parse_url(self.remote_url)
            except ConfigError as exc:   # its message shows the URL with any token masked
                raise ConfigError(f"remote_url {exc}") from None
            # a name the server refuses would fail every HELLO: the tier down for good, each call a miss
            what = "remote_namespace" if self.remote_namespace else "remote_url ?namespace="
            try:
                check_namespace(self.remote_namespace or address.namespace)
            except ConfigError as exc:
                raise ConfigError(f"{what}: {exc}") from None
        check_seconds(self.remote_timeout_s, "remote_timeout_s", positive=True)
        check_seconds(self.mooncake_timeout_s, "mooncake_timeout_s", positive=True)
        check_flag(self.encrypt_host, "encrypt_host")
        if isinstance(self.mooncake_replicas, bool) or not isinstance(self.mooncake_replicas, int) \
                or self.mooncake_replicas < 1:
            raise ConfigError(f"mooncake_replicas={self.mooncake_replicas!r}; give a whole number of copies >= 1")
        object.__setattr__(self, "host_bytes", parse_bytes(self.host_bytes, "host_bytes"))
        object.__setattr__(self, "disk_bytes", parse_bytes(self.disk_bytes, "disk_bytes"))
        if self.write_mode not in ("write-behind", "write-back", "write-through"):
            raise ConfigError(f"write_mode={self.write_mode!r}; use 'write-behind' (alias 'write-back') "
                              f"or 'write-through'")
        if isinstance(self.dirty_limit_blocks, bool) or not isinstance(self.dirty_limit_blocks, int) \
                or self.dirty_limit_blocks < 1:
            raise ConfigError(f"dirty_limit_blocks={self.dirty_limit_blocks!r}; give a whole number of blocks >= 1")
        timeout = self.close_flush_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout <= MAX_SECONDS):
            raise ConfigError(f"close_flush_timeout_s={timeout!r}; give seconds >= 0 and at most {MAX_SECONDS} "
                              f"(a day), or null for no limit")
        if self.encrypt not in ("auto", True, False):
            raise ConfigError(f"encrypt={self.encrypt!r}; use 'auto', true or false")

    @classmethod
    def from_dict(cls, values: dict) -> "StoreConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown store setting(s) {unknown}; known settings are {sorted(known)}")
        return cls(**values)

    def replace(self, **changes) -> "StoreConfig":
        return dataclasses.replace(self, **changes)

    def wants_encryption(self) -> bool:
        configured = bool(self.master_key_file or os.environ.get("KVTIER_MASTER_KEY"))
        if self.encrypt is True and not configured:
            raise ConfigError("encrypt=true needs a master key: set master_key_file or $KVTIER_MASTER_KEY")
        return configured if self.encrypt == "auto" else bool(self.encrypt)


def build_store(config: StoreConfig, layout: KVLayout, *, io_threads: int = 2):
    """A TieredStore of host → disk → remote → Mooncake as configured, encrypted where configured.
    A setting refused part-way closes the tiers already opened (their threads, pools and files)."""
    from kvtier.store.tiered import TieredStore

    encrypt = config.wants_encryption()
    opened: list = []
    try:
        tiers = _open_tiers(config, layout, encrypt, opened)
        if not tiers:
            raise ConfigError("the store has no tier: set host_bytes, disk_path, remote_url or mooncake_master")
        return TieredStore(tiers, write_mode=config.write_mode, io_threads=io_threads,
                           dirty_limit_blocks=config.dirty_limit_blocks,
                           close_flush_timeout_s=config.close_flush_timeout_s)
    except BaseException:
        for tier in reversed(opened):
            tier.close()
        raise


def _open_tiers(config: StoreConfig, layout: KVLayout, encrypt: bool, opened: list) -> list:
    """The store's tiers, top first; each one opened is appended to ``opened`` at once."""
    from kvtier.policy.eviction import make_policy
    from kvtier.tiers.host import HostTier

    disk = None
    if config.disk_path:
        from kvtier.tiers.disk import DiskTier

        disk = DiskTier(config.disk_path, config.disk_bytes, policy=make_policy(config.eviction))
        opened.append(disk)
    keyring = None
    if encrypt:
        from kvtier.crypto.keyring import Keyring
        from kvtier.crypto.providers import EnvMasterKey, FileMasterKey

        provider = FileMasterKey(config.master_key_file) if config.master_key_file else EnvMasterKey()
        keystore = config.keystore_dir or str(Path(config.disk_path or _cache_dir()) / "keys")
        # Blocks on disk need the key store they were sealed with: a missing or empty one (a
        # volume not mounted, a typo in keystore_dir) is refused, as `kvtier serve` refuses it,
        # rather than replaced by new keys under which every block there is a miss for good.
        held = sum(1 for _ in disk.keys()) if disk is not None else 0
        keyring = Keyring(provider, keystore, required_by=(
            f"{config.disk_path} holds {held} block files that need it" if held else None))

    _warn_unsafe(config, keyring is not None)

    def seal(tier):
        if keyring is None:
            return tier
        from kvtier.tiers.encrypted import EncryptedTier

        return EncryptedTier(tier, keyring, config.tenant)

    from kvtier.crypto.aead import sealed_nbytes

    slot = sealed_nbytes(layout.block_nbytes) if keyring is not None else layout.block_nbytes
    tiers = []
    if config.host_bytes:
        host = HostTier(config.host_bytes, slot if config.encrypt_host else layout.block_nbytes,
                        policy=make_policy(config.eviction))
        opened.append(host)
        tiers.append(seal(host) if config.encrypt_host else host)
    if disk is not None:
        tiers.append(seal(disk))
    if config.remote_url:
        from kvtier.tiers.remote import RemoteTier

        remote = RemoteTier(config.remote_url, token=config.remote_token, namespace=config.remote_namespace,
                            timeout_s=config.remote_timeout_s)
        opened.append(remote)
        tiers.append(seal(remote))
    if config.mooncake_master:
        fleet = _mooncake_tier(config, keyring)
        opened.append(fleet)
        tiers.append(seal(fleet))
    return tiers


def _mooncake_tier(config: StoreConfig, keyring):
    """The Mooncake tier; its names and tags are keyed by a per-tenant secret every process of the
    tenant shares: a 0600 file's bytes, or (with encryption on) one derived from the master key."""
    from kvtier.tiers.mooncake import MooncakeTier

    if config.mooncake_secret_file:
        secret = read_private_file(config.mooncake_secret_file, "mooncake_secret_file",
                                   "write a new secret to every server of the fleet")
    elif keyring is not None:
        secret = keyring.storage_key(config.tenant, b"kvtier mooncake tier secret".ljust(32, b"\0"))
    else:
        raise ConfigError("mooncake_master needs a secret for its block names: set mooncake_secret_file (a 0600 "
                          "file of >= 16 random bytes shared by the tenant's processes) or a master key")
    if len(secret) < 16:
        raise ConfigError(f"mooncake_secret_file {config.mooncake_secret_file}: {len(secret)} bytes; give >= 16")
    return MooncakeTier(config.mooncake_master, config.mooncake_metadata, tenant=config.tenant, secret=secret,
                        hostname=config.mooncake_hostname, replicas=config.mooncake_replicas,
                        timeout_s=config.mooncake_timeout_s)


def mooncake_tier_for_server(server_config, keyring=None):
    """The Mooncake tier behind ``kvtier serve`` (``mooncake_*`` of its config), built as a store's."""
    return _mooncake_tier(StoreConfig(
        host_bytes=0, tenant=server_config.mooncake_tenant, mooncake_master=server_config.mooncake_master,
        mooncake_metadata=server_config.mooncake_metadata, mooncake_hostname=server_config.mooncake_hostname,
        mooncake_replicas=server_config.mooncake_replicas, mooncake_timeout_s=server_config.mooncake_timeout_s,
        mooncake_secret_file=server_config.mooncake_secret_file), keyring)


def _warn_unsafe(config: StoreConfig, sealed: bool) -> None:
    """Said once per process: tiers outside this process in plaintext, a tenant shared by all."""
    from kvtier.store import safety

    if not sealed and config.disk_path:
        safety.warn_plaintext("disk", config.disk_path)
    if not sealed and config.remote_url:
        safety.warn_plaintext("remote", "sent to the server and kept there as they are")  # the URL may hold a token
    if not sealed and config.mooncake_master:
        safety.warn_plaintext("mooncake", "kept in plaintext in the fleet's memory (names keyed, reads verified)")
    if config.tenant == "":
        safety.warn_default_tenant("this store")


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvtier")
