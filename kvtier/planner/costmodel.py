"""Prefill and decode cost models: seconds from model geometry and calibrated rates.

Prefill of ``n`` tokens of which the first ``k`` are cached (their KV loaded, not
recomputed)::

    seconds(n, k) = overhead_s
                  + 2 * matmul_params * (n - k) / linear_flops_per_s
                  + attn_flops_per_pair * (n² - k²) / 2 / attention_flops_per_s

The quadratic attention term has its own rate because attention kernels and GEMMs
run at different efficiencies (and on a CPU, attention is memory-bound). The two
rates and the overhead are fitted from a :class:`CalibrationTable` measured on one
model (``kvtier bench prefill``) and then apply to any model's geometry on the same
hardware: rates are properties of the device, FLOPs are properties of the model.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np

from kvtier.errors import ConfigError
from kvtier.planner.models import ModelGeometry, geometry_from_hf_config


@dataclass(frozen=True, slots=True)
class CalibrationTable:
    """Measured prefill seconds against prompt tokens, on ``devices`` accelerators.

    ``model_config`` holds the HF config fields of the model measured (a preset's
    dict or the random-weight Llama of ``kvtier bench prefill``), so the fit can turn
    seconds into device rates.
    """

    accelerator: str
    devices: int
    model_config: Mapping[str, Any]
    points: tuple[tuple[int, float], ...]
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.devices <= 0:
            raise ConfigError(f"calibration {self.accelerator!r}: devices must be >= 1, got {self.devices}")
        if len(self.points) < 3:
            raise ConfigError(
                f"calibration {self.accelerator!r} has {len(self.points)} points; the fit needs >= 3 "
                "prompt lengths (run `kvtier bench prefill` with more --tokens)"
            )
        # NaN passes ``<= 0``, and then breaks the least-squares fit: finiteness first
        if any(not (math.isfinite(t) and math.isfinite(s)) or t <= 0 or s <= 0 for t, s in self.points):
            raise ConfigError(f"calibration {self.accelerator!r}: tokens and seconds must be finite and positive")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CalibrationTable":
        known = {"accelerator", "devices", "model_config", "points", "source"}
        missing = known - {"source"} - set(data)
        if missing:
            raise ConfigError(f"calibration table lacks {sorted(missing)}; write it with `kvtier bench prefill`")
        extra = {k: v for k, v in data.items() if k not in known}
        if not isinstance(data["model_config"], Mapping):
            raise ConfigError("model_config: expected the measured model's config.json object")
        try:
            points = tuple((int(t), float(s)) for t, s in data["points"])
            table = cls(str(data["accelerator"]), int(data["devices"]), dict(data["model_config"]), points,
                        str(data.get("source", "")), extra)
            # its model is read at fit time: a field of the wrong kind is said here, with the file
            geometry_from_hf_config(table.model_config, name=f"{table.accelerator}-calibration")
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as exc:
            raise ConfigError(f"points are [tokens, seconds] pairs of finite numbers and model_config a "
                              f"Hugging Face config.json ({exc})") from None
        return table

    def to_json(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator, "devices": self.devices, "model_config": dict(self.model_config),
                "points": [list(p) for p in self.points], "source": self.source, **dict(self.extra)}


class PrefillFit(NamedTuple):
    overhead_s: float
    linear_flops_per_s: float
    attention_flops_per_s: float
    max_relative_error: float


def fit_rates(table: CalibrationTable) -> PrefillFit:
    """Fit ``overhead + a * linear_flops + b * attention_flops`` to the table, all terms >= 0.

    Least squares on relative error (each row divided by its measured seconds), so a
    short prompt counts as much as a long one. Non-negativity by trying every subset
    of the three terms (exact for three unknowns) and keeping the best feasible one.
    """
    model = geometry_from_hf_config(table.model_config, name=f"{table.accelerator}-calibration")
    tokens = np.array([t for t, _ in table.points], dtype=float)
    seconds = np.array([s for _, s in table.points], dtype=float)
    columns = np.stack([np.ones_like(tokens), model.linear_flops(tokens), model.attention_flops(tokens)], axis=1)
    weighted = columns / seconds[:, None]
    target = np.ones_like(seconds)
    best: tuple[float, np.ndarray] | None = None
    for size in (3, 2, 1):
        for subset in itertools.combinations(range(3), size):
            if 1 not in subset:  # the linear term is what prefill is; never drop it
                continue
            coef, *_ = np.linalg.lstsq(weighted[:, subset], target, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[list(subset)] = coef
            err = float(np.sum((weighted @ full - target) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, full)
    if best is None:
        raise ConfigError(f"calibration {table.accelerator!r}: no non-negative fit; are the seconds increasing with tokens?")
    overhead, inv_linear, inv_attention = best[1]
    rel = np.abs(columns @ best[1] - seconds) / seconds
    return PrefillFit(
        overhead_s=float(overhead),
        linear_flops_per_s=float(1.0 / inv_linear),
        attention_flops_per_s=float(1.0 / inv_attention) if inv_attention > 0 else float("inf"),
        max_relative_error=float(rel.max()),
    )


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """Seconds to prefill a prompt on one worker of ``devices`` accelerators."""

    model: ModelGeometry
    linear_flops_per_s: float
    attention_flops_per_s: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.linear_flops_per_s <= 0 or self.attention_flops_per_s <= 0 or self.overhead_s < 0:
            raise ConfigError("prefill rates must be positive and the overhead >= 0")

    @classmethod
    def from_roofline(cls, model: ModelGeometry, peak_flops_per_s: float, devices: int, efficiency: float,
                      attention_efficiency: float | None = None, overhead_s: float = 0.0) -> "PrefillCostModel":
        """Rates as a fraction of the devices' peak (MFU), for what-if questions without measurements."""
        if not 0 < efficiency <= 1 or (attention_efficiency is not None and not 0 < attention_efficiency <= 1):
            raise ConfigError(f"efficiency is a fraction of peak in (0, 1], got {efficiency}")
        peak = peak_flops_per_s * devices
        return cls(model, peak * efficiency, peak * (attention_efficiency or efficiency), overhead_s)

    @classmethod
    def from_calibration(cls, model: ModelGeometry, table: CalibrationTable,
                         devices: int | None = None) -> "PrefillCostModel":
        """Rates fitted on ``table``, scaled linearly to ``devices`` (tensor parallel is assumed
        to scale as well as it did in the measurement)."""
        fit = fit_rates(table)
        scale = (devices or table.devices) / table.devices
        return cls(model, fit.linear_flops_per_s * scale, fit.attention_flops_per_s * scale, fit.overhead_s)

    def seconds(self, tokens: float, cached_tokens: float = 0.0) -> float:
        """Prefill time of ``tokens`` with the first ``cached_tokens`` already in place.

        At least one token is always computed: the first output token needs it.
        """
        cached = min(cached_tokens, tokens - 1)
        new = tokens - cached
        return (self.overhead_s + self.model.linear_flops(new) / self.linear_flops_per_s
                + self.model.attention_flops(tokens, cached) / self.attention_flops_per_s)


@dataclass(frozen=True, slots=True)
class DecodeCostModel:
    """Seconds per decode step of a batch: memory-bound reads of weights and KV, or compute.

    A step reads every weight its batch uses once and every cached token's KV once, so
    ``step_s = overhead + (weight_bytes + kv_tokens * bytes_per_token) / hbm_bytes_per_s``
    unless the batch's matmuls take longer (large batches). A dense model's batch uses every
    weight; a mixture of experts' batch, the dense weights and the experts some sequence of it
    is routed to (:meth:`ModelGeometry.weights_read`), far more than one token's active ones.
    """

    model: ModelGeometry
    hbm_bytes_per_s: float
    flops_per_s: float
    weight_itemsize: int = 2
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.hbm_bytes_per_s <= 0 or self.flops_per_s <= 0:
            raise ConfigError("decode bandwidth and FLOP rate must be positive")

    def step_seconds(self, batch: int, kv_tokens: float) -> float:
        memory = (self.model.weights_read(batch) * self.weight_itemsize
                  + kv_tokens * self.model.bytes_per_token) / self.hbm_bytes_per_s
        compute = self.model.linear_flops(batch) / self.flops_per_s
        return self.overhead_s + max(memory, compute)

    def max_batch_for_itl(self, itl_s: float, kv_tokens_per_request: float) -> int:
        """The largest batch whose step stays within ``itl_s`` (0 when even one request misses it)."""
        lo, hi = 0, 1
        while self.step_seconds(hi, hi * kv_tokens_per_request) <= itl_s and hi < 1 << 20:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.step_seconds(mid, mid * kv_tokens_per_request) <= itl_s:
                lo = mid
            else:
                hi = mid
        return lo
