"""The scheduling policies by name (``--policy``): the paper's and the baselines, each a ``Policy``
(``dualpath.scheduler.policy``, which they all build on)."""

from __future__ import annotations

from dualpath.scheduler.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from dualpath.scheduler.paper import DualPathPolicy
from dualpath.scheduler.policy import Policy

POLICIES = {
    "dualpath": DualPathPolicy,
    "least-loaded": LeastLoadedPolicy,
    "round-robin": RoundRobinPolicy,
    "random": RandomPolicy,
}


def make_policy(name: str, recompute_slow_hits: bool = False, **kwargs) -> Policy:
    """A fresh policy ``name`` (one of ``POLICIES``); ``recompute_slow_hits``: recompute hits whose read would take
    longer than computing them (live schedulers; the paper's systems load every hit)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    policy = POLICIES[name](**kwargs)
    policy.recompute_slow_hits = recompute_slow_hits
    return policy
