"""The simulated cluster's configuration: workers, the accelerator, HBM and the tiers below it.

The default ships as ``kvtier/data/cluster_default.json``. Capacities and bandwidths
are bytes and bytes per second; a tier's ``capacity_bytes`` of ``null`` is unbounded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvtier.errors import ConfigError
from kvtier.json_files import read_json_object
from kvtier.planner.hardware import read_data_json

TIER_SCOPES = ("worker", "pod")
#: tiers below HBM a cluster may have: a worker's load plan tries every set of the tiers
#: holding a prompt's prefix (``ServiceModel.plan_any``), 2**k of them
MAX_TIERS = 8


def _reject_unknown(cls, data: Mapping[str, Any], what: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known - {"_about"}
    if unknown:
        raise ConfigError(f"{what}: unknown field(s) {sorted(unknown)}; known fields are {sorted(known)}")


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier below HBM. ``scope`` "worker": each prefill worker has its own (host DRAM,
    local NVMe); "pod": one instance shared by every worker (the kvtier server tier).
    ``read_bytes_per_s`` is what one worker can read from it (for a pod tier, the
    worker's network link); ``latency_s`` is paid once per request that reads from it."""

    name: str
    scope: str
    capacity_bytes: float | None
    read_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.scope not in TIER_SCOPES:
            raise ConfigError(f"tier {self.name!r}: scope must be one of {TIER_SCOPES}, got {self.scope!r}")
        # NaN passes every comparison below: finiteness first (null, not Infinity, is unbounded)
        if self.capacity_bytes is not None and not (math.isfinite(self.capacity_bytes) and self.capacity_bytes >= 0):
            raise ConfigError(f"tier {self.name!r}: capacity_bytes must be a finite number >= 0 or null (unbounded)")
        if not (math.isfinite(self.read_bytes_per_s) and math.isfinite(self.latency_s)) \
                or self.read_bytes_per_s <= 0 or self.latency_s < 0:
            raise ConfigError(f"tier {self.name!r}: read_bytes_per_s must be a finite number > 0 and latency_s >= 0")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A disaggregated serving cluster: prefill workers with an HBM prefix cache and the
    tiers below it, decode workers that receive the KV. A worker is ``devices_per_worker``
    accelerators serving one model replica (tensor parallel)."""

    model: str = "llama-3-70b"
    accelerator: str = "h100"
    devices_per_worker: int = 8
    prefill_workers: int = 4
    decode_workers: int = 2
    block_tokens: int = 512
    hbm_cache_bytes: float = 300e9
    decode_kv_bytes: float = 400e9
    transfer_bytes_per_s: float = 50e9
    tiers: tuple[TierSpec, ...] = ()
    calibration: str | None = None

    def __post_init__(self) -> None:
        for name in ("devices_per_worker", "prefill_workers", "decode_workers", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"cluster {name} must be a positive integer, got {value!r}")
        for name in ("model", "accelerator"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"cluster {name} must be a string, got {getattr(self, name)!r:.40}")
        if self.calibration is not None and not isinstance(self.calibration, str):
            raise ConfigError(f"cluster calibration must be a path (a string) or null, got {self.calibration!r:.40}")
        sizes = (self.hbm_cache_bytes, self.decode_kv_bytes, self.transfer_bytes_per_s)
        if not all(map(math.isfinite, sizes)) or self.hbm_cache_bytes < 0 or self.decode_kv_bytes <= 0 \
                or self.transfer_bytes_per_s <= 0:
            raise ConfigError("cluster hbm_cache_bytes must be a finite number >= 0, decode_kv_bytes and "
                              "transfer_bytes_per_s finite and > 0")
        if len(self.tiers) > MAX_TIERS:
            raise ConfigError(f"cluster has {len(self.tiers)} tiers below HBM; at most {MAX_TIERS} (each load plan "
                              "tries every set of the tiers holding the prefix)")
        names = [t.name for t in self.tiers]
        if "hbm" in names or len(set(names)) != len(names):
            raise ConfigError(f"tier names must be distinct and not 'hbm' (HBM is implicit), got {names}")

    @property
    def tier_names(self) -> tuple[str, ...]:
        """``hbm`` first, then the configured tiers, fastest first."""
        return ("hbm", *(t.name for t in self.tiers))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ClusterConfig":
        _reject_unknown(cls, data, "cluster config")
        tiers = []
        if not isinstance(data.get("tiers", ()), (list, tuple)):
            raise ConfigError("cluster config tiers: expected a list of tier objects")
        for i, tier in enumerate(data.get("tiers", ())):
            if not isinstance(tier, Mapping):
                raise ConfigError(f"cluster config tiers[{i}]: expected an object, got {tier!r:.40}")
            _reject_unknown(TierSpec, tier, f"cluster config tiers[{i}]")
            missing = [f.name for f in dataclasses.fields(TierSpec)
                       if f.name not in tier and f.default is dataclasses.MISSING]
            if missing:
                raise ConfigError(f"cluster config tiers[{i}]: missing field(s) {missing}")
            tiers.append(TierSpec(**tier))
        fields = {k: v for k, v in data.items() if k not in ("tiers", "_about")}
        for name in ("hbm_cache_bytes", "decode_kv_bytes", "transfer_bytes_per_s"):
            if name in fields:
                fields[name] = float(fields[name])
        return cls(**fields, tiers=tuple(tiers))

    def replace(self, **changes: Any) -> "ClusterConfig":
        return dataclasses.replace(self, **changes)


def load_cluster(path: str | Path | None = None) -> ClusterConfig:
    """The cluster at ``path``, or the default shipped with kvtier."""
    if path is None:
        return ClusterConfig.from_json(read_data_json("cluster_default.json"))
    if not Path(path).exists():
        raise ConfigError(f"cluster config {path} not found (omit --cluster for the shipped default)")
    data = read_json_object(path, "cluster config")
    try:
        return ClusterConfig.from_json(data)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:   # a missing field, a size not a number (or past a float)
        raise ConfigError(f"cluster config {path}: {exc}") from None
