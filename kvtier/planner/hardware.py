"""Accelerator specs and calibration tables shipped in ``kvtier/data``, and the cost models built from them.

Which prefill rates the planner uses, in order of preference:

1. a calibration table given by path (``--calibration profile.json``);
2. a measured table shipped as ``kvtier/data/prefill_<accelerator>.json`` (the CPU
   profile measured on the development machine by ``kvtier bench prefill``);
3. the roofline: the datasheet peak times the ``prefill_mfu`` of ``accelerators.json``.

The answer says which one it used (``CostModels.provenance``), so a figure is never
presented as measured when it is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.errors import ConfigError
from kvtier.json_files import read_json_object
from kvtier.planner.costmodel import CalibrationTable, DecodeCostModel, PrefillCostModel
from kvtier.planner.models import ModelGeometry


def read_data_json(name: str) -> dict[str, Any]:
    """A JSON file shipped in ``kvtier/data``."""
    return json.loads(resources.files("kvtier").joinpath("data", name).read_text())


def has_data_file(name: str) -> bool:
    return resources.files("kvtier").joinpath("data", name).is_file()


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    peak_flops_per_s: float | None = None
    prefill_mfu: float | None = None
    decode_bw_efficiency: float = 0.7

    def __post_init__(self) -> None:
        if self.hbm_bytes <= 0 or self.hbm_bytes_per_s <= 0:
            raise ConfigError(f"accelerator {self.name!r}: memory size and bandwidth must be positive")
        if not 0 < self.decode_bw_efficiency <= 1:
            raise ConfigError(f"accelerator {self.name!r}: decode_bw_efficiency is a fraction in (0, 1]")


def load_accelerator(name: str, table: CalibrationTable | None = None) -> Accelerator:
    """Specs from ``accelerators.json``, or, for a measured host such as the CPU, from its
    calibration ``table`` (default: the one shipped for ``name``)."""
    specs = read_data_json("accelerators.json")
    key = name.lower()
    if key in specs and not key.startswith("_"):
        s = specs[key]
        return Accelerator(key, float(s["hbm_bytes"]), float(s["hbm_bytes_per_s"]), float(s["peak_flops_per_s"]),
                           float(s["prefill_mfu"]), float(s.get("decode_bw_efficiency", 0.7)))
    table = table or find_calibration(key)
    if table is not None and "memory_bytes" in table.extra:
        # A measured host (the CPU profile): memory and its bandwidth were measured with it.
        return Accelerator(key, float(table.extra["memory_bytes"]), float(table.extra["memory_bytes_per_s"]),
                           decode_bw_efficiency=1.0)
    known = sorted(k for k in specs if not k.startswith("_"))
    raise ConfigError(f"unknown accelerator {name!r}; use one of {known} or measure one with `kvtier bench prefill`")


def find_calibration(accelerator: str, path: str | Path | None = None) -> CalibrationTable | None:
    if path is not None:
        try:
            return CalibrationTable.from_json(read_json_object(path, "calibration table"))
        except ConfigError as exc:
            if str(path) in str(exc):   # read_json_object's own errors name the file already
                raise
            raise ConfigError(f"calibration table {path}: {exc}") from None
    name = f"prefill_{accelerator.lower()}.json"
    if has_data_file(name):
        return CalibrationTable.from_json(read_data_json(name))
    return None


class CostModels(NamedTuple):
    prefill: PrefillCostModel
    decode: DecodeCostModel
    accelerator: Accelerator
    provenance: str


def cost_models(model: ModelGeometry, accelerator: str, devices: int,
                calibration_path: str | Path | None = None) -> CostModels:
    """Prefill and decode cost models for ``devices`` accelerators serving ``model``."""
    if devices <= 0:
        raise ConfigError(f"devices per worker must be >= 1, got {devices}")
    table = find_calibration(accelerator, calibration_path)
    accel = load_accelerator(accelerator, table)
    if table is not None:
        prefill = PrefillCostModel.from_calibration(model, table, devices)
        provenance = f"prefill fitted on {len(table.points)} measured points ({table.source or table.accelerator})"
    elif accel.peak_flops_per_s and accel.prefill_mfu:
        prefill = PrefillCostModel.from_roofline(model, accel.peak_flops_per_s, devices, accel.prefill_mfu)
        provenance = (f"prefill from roofline: {accel.peak_flops_per_s / 1e12:.0f} TFLOP/s x {devices} x "
                      f"{accel.prefill_mfu:.0%} MFU (no measured table for {accel.name})")
    else:
        raise ConfigError(f"accelerator {accel.name!r} has neither a measured table nor a peak; run `kvtier bench prefill`")
    # A large decode batch is GEMM-bound at the rate prefill GEMMs reach on the same devices.
    decode = DecodeCostModel(model, accel.hbm_bytes_per_s * devices * accel.decode_bw_efficiency,
                             flops_per_s=prefill.linear_flops_per_s)
    return CostModels(prefill, decode, accel, provenance)
