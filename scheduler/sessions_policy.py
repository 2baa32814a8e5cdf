"""When to prefetch an agent session's stored KV while its tool runs: the gap estimator and the prefetch-time rule,
as pure code that the scheduler (``dualpath.scheduler.sessions``) and the cluster simulator (``dualpath.sim``) share.

A turn of a session ends; the agent runs a tool for a gap G; the next turn re-sends the whole context. The gap is
measured by the scheduler as the submit of the next turn minus the end of the turn before.

**Estimator.** Gaps are modelled as log-normal: ``log G ~ N(mu, sigma^2)``. A session's own gaps are shrunk toward a
global prior, the mean and variance of ``log G`` over every session's gaps, its own included (``GapPrior``), which
weighs as ``PRIOR_WEIGHT`` (2) pseudo-observations: ``mu`` and ``sigma^2`` are the mean and (maximum-likelihood)
variance of the session's log gaps pooled with 2 observations distributed as the prior,

    mu      = (w mu_p + n m) / (w + n)
    sigma^2 = (w var_p + n s^2 + (w n / (w + n)) (m - mu_p)^2) / (w + n)

with n, m, s^2 the count, mean and variance (over n) of the session's log gaps and w = 2. One gap moves the
estimate a third of the way to it; after 8, the session's own gaps weigh 80%. Before any gap of the session is
seen: a client's hint (``next_turn_in_s``) is the median (``sigma`` the prior's, or 0), else the prior, else nothing
is known (prefetch at once). ``GapEstimator.observe`` also feeds the prior, so one call records a gap everywhere.
Gaps are floored at ``MIN_GAP_S`` (a next turn submitted before the end of the last, clocks apart, is a tiny gap).

**Prefetch time.** ``prefetch_at``: the end of the turn plus ``max(0, q20 - 1.5 x load_time)``, where ``q20`` is the
estimate's 20th percentile and ``load_time`` the session's stored KV bytes over the node's measured storage read
rate (``load_time``). Reading then finishes before the next turn in ~80% of gaps with the 1.5x margin for a busy
node, and the read starts no earlier than needed, so the buffer holds it for as short as it can.
**Expiry.** ``hold_time``: a prefetch not used by then is freed (counted as wasted): ``max(30 s, 3 x the expected
gap)``, the expected gap being the estimate's mean ``exp(mu + sigma^2 / 2)``.

Standard library only (and nothing of ``dualpath``): the runtime scheduler and the simulator import the same code.
"""

from __future__ import annotations

import math
from statistics import NormalDist

PRIOR_WEIGHT = 2.0  # the global prior counts as this many observations of a session's gaps
PREFETCH_QUANTILE = 0.2  # prefetches aim at this quantile of the gap
LOAD_MARGIN = 1.5  # x the session's load time: room for a busy node
MIN_HOLD_S = 30.0  # a prefetch is kept at least this long ...
HOLD_GAPS = 3.0  # ... or this many expected gaps
MIN_GAP_S = 1e-3  # gaps are floored here before their log is taken

_NORMAL = NormalDist()


def _log_gap(gap_s: float) -> float:
    if isinstance(gap_s, bool) or not isinstance(gap_s, (int, float)) or math.isnan(gap_s):
        raise ValueError(f"a gap is a number of seconds, got {gap_s!r}")
    if math.isinf(gap_s):
        raise ValueError("a gap must be finite")
    return math.log(max(MIN_GAP_S, float(gap_s)))


def _z(q: float) -> float:
    if not 0 < q < 1:
        raise ValueError(f"a quantile is in (0, 1), got {q!r}")
    return _NORMAL.inv_cdf(q)


class _LogMoments:
    """Count, mean and sum of squared deviations of log gaps, updated one at a time (Welford)."""

    __slots__ = ("count", "_mean", "_m2")

    def __init__(self) -> None:
        self.count, self._mean, self._m2 = 0, 0.0, 0.0

    def _add(self, x: float) -> None:
        self.count += 1
        d = x - self._mean
        self._mean += d / self.count
        self._m2 += d * (x - self._mean)

    @property
    def mean_log(self) -> float | None:
        """The mean of the log gaps seen (None before the first)."""
        return self._mean if self.count else None

    @property
    def var_log(self) -> float | None:
        """Their variance, over the count (the maximum-likelihood one); None before the first."""
        return max(0.0, self._m2 / self.count) if self.count else None


class GapPrior(_LogMoments):
    """The global prior: the log gaps of every session, each gap weighing the same. Fed by ``GapEstimator.observe``
    (or ``observe`` here, for gaps no session estimator records)."""

    __slots__ = ()

    def observe(self, gap_s: float) -> None:
        self._add(_log_gap(gap_s))

    def quantile(self, q: float) -> float | None:
        """The prior's ``q`` quantile of the gap in seconds (None before any gap is seen)."""
        if not self.count:
            return None
        return math.exp(self._mean + math.sqrt(self.var_log) * _z(q))

    def median(self) -> float | None:
        return math.exp(self._mean) if self.count else None


class GapEstimator(_LogMoments):
    """One session's gap estimate: its own log gaps, shrunk toward ``prior`` (``weight`` pseudo-observations)."""

    __slots__ = ("prior", "weight")

    def __init__(self, prior: GapPrior | None = None, weight: float = PRIOR_WEIGHT):
        super().__init__()
        if not weight >= 0 or math.isinf(weight):
            raise ValueError(f"the prior's weight is a finite number >= 0, got {weight!r}")
        self.prior = prior if prior is not None else GapPrior()
        self.weight = float(weight)

    def observe(self, gap_s: float) -> None:
        """A measured gap (seconds) of this session; the prior learns it too."""
        x = _log_gap(gap_s)
        self._add(x)
        self.prior._add(x)

    def log_params(self, hint_s: float | None = None) -> tuple[float, float] | None:
        """``(mu, sigma)`` of the log gap; None when nothing is known (no gap of this session, no hint, no prior).
        ``hint_s``: the client's estimate of the coming gap, used only before this session's first gap."""
        prior = self.prior
        p_var = prior.var_log
        if not self.count:
            if hint_s is not None:
                return _log_gap(hint_s), math.sqrt(p_var or 0.0)
            if not prior.count:
                return None
            return prior._mean, math.sqrt(p_var)
        n, m, s2 = self.count, self._mean, self.var_log
        w = self.weight if prior.count else 0.0  # (observe feeds the prior: empty only for a prior set aside)
        p_mean = prior._mean if prior.count else 0.0
        mu = (w * p_mean + n * m) / (w + n)
        var = (w * (p_var or 0.0) + n * s2 + (w * n / (w + n)) * (m - p_mean) ** 2) / (w + n)
        return mu, math.sqrt(max(0.0, var))

    def quantile(self, q: float, hint_s: float | None = None) -> float | None:
        """The estimate's ``q`` quantile of the gap in seconds (None: nothing known)."""
        z = _z(q)
        p = self.log_params(hint_s)
        return None if p is None else math.exp(p[0] + p[1] * z)

    def median(self, hint_s: float | None = None) -> float | None:
        p = self.log_params(hint_s)
        return None if p is None else math.exp(p[0])

    def mean(self, hint_s: float | None = None) -> float | None:
        """The expected gap, ``exp(mu + sigma^2 / 2)`` (None: nothing known)."""
        p = self.log_params(hint_s)
        return None if p is None else math.exp(p[0] + p[1] ** 2 / 2)


def load_time(stored_bytes: float, read_bps: float) -> float:
    """Seconds to read ``stored_bytes`` at the node's measured read rate ``read_bps`` (bytes/s); an unknown rate
    (0) reads as forever, so a prefetch goes out at once."""
    if stored_bytes < 0 or read_bps < 0 or math.isnan(stored_bytes) or math.isnan(read_bps):
        raise ValueError(f"bytes and rate are >= 0, got {stored_bytes!r} and {read_bps!r}")
    if stored_bytes == 0:
        return 0.0
    return stored_bytes / read_bps if read_bps > 0 else math.inf


def prefetch_delay(q20_s: float | None, load_s: float, margin: float = LOAD_MARGIN) -> float:
    """The rule on numbers: seconds after the end of a turn to issue its prefetch, ``max(0, q20 - margin x load)``;
    ``q20_s`` None (nothing known about the gap) or an infinite load: at once (0)."""
    if load_s < 0 or math.isnan(load_s):
        raise ValueError(f"a load time is >= 0, got {load_s!r}")
    if q20_s is None or math.isinf(load_s):
        return 0.0
    if q20_s < 0 or math.isnan(q20_s):
        raise ValueError(f"a gap quantile is >= 0, got {q20_s!r}")
    return max(0.0, q20_s - margin * load_s)


def prefetch_at(end_s: float, gaps: GapEstimator, load_s: float, hint_s: float | None = None) -> float:
    """When to issue the prefetch of a session whose turn ended at ``end_s``, whose gaps ``gaps`` estimates and
    whose stored KV takes ``load_s`` to read (``load_time``): ``end + max(0, q20(gap) - 1.5 x load_s)``; at once when
    nothing is known. ``hint_s``: the client's estimate of this gap (used before the session's first gap)."""
    return end_s + prefetch_delay(gaps.quantile(PREFETCH_QUANTILE, hint_s), load_s)


def hold_time(gaps: GapEstimator, hint_s: float | None = None) -> float:
    """How long a prefetch is kept unused before it is freed (wasted): ``max(30 s, 3 x the expected gap)``."""
    expected = gaps.mean(hint_s)
    return max(MIN_HOLD_S, HOLD_GAPS * expected) if expected is not None else MIN_HOLD_S
