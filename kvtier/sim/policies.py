"""Routing policies of the simulator: the one implementation in :mod:`kvtier.policy.routing`.

Kept as a module so that ``from kvtier.sim.policies import …`` goes on working;
``kvtier route`` imports the same classes, so the simulator and the router decide alike.
"""

from __future__ import annotations

from kvtier.policy.routing import (  # noqa: F401  (re-exported)
    ALL_POLICIES,
    POLICIES,
    Approximate,
    ClusterView,
    LeastLoaded,
    PrefixOverlap,
    RoundRobin,
    RoutingPolicy,
    TierAware,
    make_policy,
)
