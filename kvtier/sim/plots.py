"""PNG plots of a simulation: TTFT CDF per policy, hit rate against cache capacity.

matplotlib is imported here, lazily, and only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.sim.cache import ReplayResult
from kvtier.sim.simulator import SimResult


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'kvtier[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(results: Mapping[str, SimResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        ttft = np.sort([o.ttft_s for o in result.outcomes])
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=f"{name} (p50 {np.median(ttft):.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT by routing policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hit_rate_curve(curve: Sequence[ReplayResult], block_bytes: int, path: Path,
                        marks: Mapping[str, float] | None = None) -> Path:
    """Hit rate of one shared LRU cache against its capacity; ``marks`` are capacities (bytes)
    drawn as vertical lines, e.g. the configured tiers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    capacity_tb = [r.capacity_blocks * block_bytes / 1e12 for r in curve]
    ax.plot(capacity_tb, [100 * r.block_hit_rate for r in curve], marker="o", label="blocks")
    ax.plot(capacity_tb, [100 * r.token_hit_rate for r in curve], marker=".", linestyle="--", label="tokens")
    for label, capacity in (marks or {}).items():
        ax.axvline(capacity / 1e12, color="grey", linestyle=":")
        # x in data units, y in axes units: the label sits at the bottom whatever the range
        ax.text(capacity / 1e12, 0.03, f" {label}", rotation=90, fontsize=8, color="grey",
                transform=ax.get_xaxis_transform(), va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("shared LRU cache capacity (TB)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title("Hit rate against capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
