"""Capacity sizing: how many bytes of context memory a user population needs.

The formula, printed by ``kvtier plan capacity``::

    session_bytes = context_tokens x bytes_per_token x (1 + format_overhead)
    total_bytes   = users x sessions x session_bytes x replication

and the split across tiers: the sessions of the users active at once are the hot set
(host DRAM next to the GPUs); every retained session lives in the shared pod tier.
All byte figures are decimal (1 TB = 10^12 B), as storage is sold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvtier.errors import ConfigError
from kvtier.planner.models import ModelGeometry


@dataclass(frozen=True, slots=True)
class CapacityInputs:
    """A sizing question; validated on construction.

    ``format_overhead`` covers the block header, AEAD tag and padding as a fraction
    of the raw KV (0.0 for the bare figure); ``replication`` is the number of copies
    the shared tier keeps; ``active_fraction`` is the share of users whose current
    session is resident in host DRAM at once.
    """

    users: int
    context_tokens: int
    sessions: tuple[int, ...] = (1,)
    replication: float = 1.0
    format_overhead: float = 0.0
    active_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.users <= 0 or self.context_tokens <= 0:
            raise ConfigError("users and context tokens must be positive (e.g. --users 10000 --context-tokens 100000)")
        if not self.sessions or any(s <= 0 for s in self.sessions):
            raise ConfigError(f"sessions per user must be positive integers, got {self.sessions}")
        if self.replication < 1.0:
            raise ConfigError(f"replication is a number of copies >= 1, got {self.replication}")
        if self.format_overhead < 0.0:
            raise ConfigError(f"format overhead is a fraction >= 0 (0.02 for 2 %), got {self.format_overhead}")
        if not 0.0 < self.active_fraction <= 1.0:
            raise ConfigError(f"active fraction must lie in (0, 1], got {self.active_fraction}")


class CapacityRow(NamedTuple):
    sessions: int
    total_bytes: float
    host_dram_bytes: float
    shared_tier_bytes: float


class CapacityPlan(NamedTuple):
    model: str
    bytes_per_token: int
    kv_formula: str
    session_bytes: float
    rows: list[CapacityRow]


def plan_capacity(model: ModelGeometry, inputs: CapacityInputs) -> CapacityPlan:
    session_bytes = inputs.context_tokens * model.bytes_per_token * (1.0 + inputs.format_overhead)
    active_users = inputs.users * inputs.active_fraction
    rows = []
    for sessions in inputs.sessions:
        total = inputs.users * sessions * session_bytes * inputs.replication
        rows.append(CapacityRow(
            sessions=sessions,
            total_bytes=total,
            # Only the session in use is hot; older sessions wait in the shared tier.
            host_dram_bytes=active_users * session_bytes,
            shared_tier_bytes=total,
        ))
    return CapacityPlan(model.name, model.bytes_per_token, model.kv_formula(), session_bytes, rows)


def human_bytes(n: float) -> str:
    """Decimal units, as in storage sizing guides (1 PB = 10^15 B)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def render_plan(plan: CapacityPlan, inputs: CapacityInputs) -> str:
    lines = [
        f"model {plan.model}: {plan.kv_formula}",
        f"session = {inputs.context_tokens:,} tokens x {plan.bytes_per_token:,} B"
        f" x (1 + {inputs.format_overhead:g} overhead) = {human_bytes(plan.session_bytes)}"
        f" ({plan.session_bytes / 2**30:.1f} GiB)",
        f"total = {inputs.users:,} users x sessions x session x {inputs.replication:g} replicas;"
        f" host DRAM = {inputs.active_fraction:g} of users active x 1 session",
        f"{'sessions/user':>14} {'total':>10} {'shared tier':>12} {'host DRAM':>10}",
    ]
    for row in plan.rows:
        lines.append(f"{row.sessions:>14} {human_bytes(row.total_bytes):>10}"
                     f" {human_bytes(row.shared_tier_bytes):>12} {human_bytes(row.host_dram_bytes):>10}")
    return "\n".join(lines)
