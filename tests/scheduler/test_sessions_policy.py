"""The session gap estimator and the prefetch-time rule (``dualpath.scheduler.sessions_policy``): the estimate
against a float64 reference (a log-normal fitted to the session's log gaps pooled with two pseudo-observations of
the prior, quantiles by scipy), and the rule at its boundaries."""

import math

import numpy as np
import pytest

from dualpath.scheduler.sessions_policy import (
    MIN_GAP_S,
    GapEstimator,
    GapPrior,
    hold_time,
    load_time,
    prefetch_at,
    prefetch_delay,
)

QS = (0.05, 0.2, 0.5, 0.9, 0.99)
REL = 1e-9  # Welford updates against two-pass float64 sums: ~1e-15 apart in the logs; exp keeps it far below this


def reference(own, everyone, hint=None, weight=2.0):
    """(mu, sigma) of the log gap: the session's log gaps (weight 1 each) pooled with the prior, the log gaps of
    ``everyone`` (the session's included), as two points mean -/+ sd of weight ``weight`` / 2 each (they have the
    prior's mean and variance); the maximum-likelihood mean and variance of that weighted sample."""
    logs = lambda xs: np.log(np.maximum(MIN_GAP_S, np.asarray(xs, dtype=np.float64)))  # noqa: E731
    all_logs = logs(everyone)
    mu_p, sd_p = (all_logs.mean(), all_logs.std()) if len(all_logs) else (None, 0.0)
    if not len(own):
        if hint is not None:
            return math.log(hint), sd_p
        return None if mu_p is None else (mu_p, sd_p)
    pts = np.concatenate([logs(own), [mu_p - sd_p, mu_p + sd_p]])
    w = np.concatenate([np.ones(len(own)), [weight / 2, weight / 2]])
    mu = np.average(pts, weights=w)
    return mu, math.sqrt(np.average((pts - mu) ** 2, weights=w))


@pytest.mark.parametrize("seed", range(6))
def test_the_estimate_is_a_lognormal_fit_shrunk_toward_the_prior(seed):
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(seed)
    prior = GapPrior()
    others = rng.lognormal(rng.normal(1, 1), rng.uniform(0.2, 2), int(rng.integers(0, 40))).tolist()
    for g in others:
        prior.observe(g)
    est = GapEstimator(prior)
    own = []
    for g in [0.0, *rng.lognormal(rng.normal(0, 1.5), rng.uniform(0.1, 1.5), 12).tolist()]:  # 0: floored
        ref = reference(own, others + own)
        got = est.log_params()
        if ref is None:
            assert got is None and est.quantile(0.2) is None and est.mean() is None
        elif ref[1] < 1e-12:  # one distinct gap so far: a point (scipy's lognorm needs sigma > 0)
            assert got[1] == pytest.approx(0.0, abs=1e-9)
            assert all(est.quantile(q) == pytest.approx(math.exp(ref[0]), rel=REL) for q in QS)
        else:
            want = stats.lognorm(s=ref[1], scale=math.exp(ref[0]))
            for q in QS:
                assert est.quantile(q) == pytest.approx(want.ppf(q), rel=REL)
            assert est.median() == pytest.approx(want.median(), rel=REL)
            assert est.mean() == pytest.approx(want.mean(), rel=REL)
        est.observe(g)
        own.append(g)
    assert prior.count == len(others) + len(own)  # the session's gaps fed the prior too


def test_a_hint_stands_in_before_the_first_gap_only():
    stats = pytest.importorskip("scipy.stats")
    prior = GapPrior()
    est = GapEstimator(prior)
    assert est.quantile(0.2, hint_s=4.0) == pytest.approx(4.0)  # no prior: sigma 0, every quantile the hint
    assert est.quantile(0.2) is None  # nothing known: prefetch at once
    for g in (1.0, 3.0, 9.0):
        prior.observe(g)
    mu, sd = reference([], [1.0, 3.0, 9.0], hint=4.0)
    assert est.quantile(0.2, hint_s=4.0) == pytest.approx(stats.lognorm(s=sd, scale=4.0).ppf(0.2), rel=REL)
    assert est.quantile(0.5) == pytest.approx(3.0, rel=REL)  # no hint: the prior's median
    est.observe(2.0)
    assert est.quantile(0.2, hint_s=100.0) == est.quantile(0.2)  # a gap of its own: the hint is ignored


def test_one_gap_moves_the_median_a_third_of_the_way():
    prior = GapPrior()
    est = GapEstimator(prior)
    other = GapEstimator(prior)
    for _ in range(50):
        other.observe(2.0)
    est.observe(2.0 * math.e**3)
    # prior: 50 gaps of log 2 and this one; the session's mean log is 3 above: w=2, n=1
    mu_p = math.log(2) + 3 / 51
    assert est.median() == pytest.approx(math.exp((2 * mu_p + math.log(2) + 3) / 3), rel=REL)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "1", None])
def test_a_gap_that_is_not_a_finite_number_is_refused(bad):
    with pytest.raises(ValueError):
        GapEstimator().observe(bad)


def test_negative_and_zero_gaps_are_floored():
    est = GapEstimator()
    est.observe(-5.0)
    est.observe(0.0)
    assert est.median() == pytest.approx(MIN_GAP_S)


def test_prefetch_delay_at_its_boundaries():
    assert prefetch_delay(None, 1.0) == 0.0  # nothing known: at once
    assert prefetch_delay(3.0, 2.0) == 0.0  # q20 == 1.5 x load: at once
    assert prefetch_delay(2.0, 2.0) == 0.0  # the read would not finish in time anyway: at once
    assert prefetch_delay(3.0 + 1e-6, 2.0) == pytest.approx(1e-6)
    assert prefetch_delay(10.0, 2.0) == 7.0
    assert prefetch_delay(10.0, 0.0) == 10.0  # nothing to read
    assert prefetch_delay(10.0, math.inf) == 0.0  # an unknown read rate
    assert prefetch_delay(0.0, 0.0) == 0.0
    for q, load in ((-1.0, 1.0), (1.0, -1.0), (math.nan, 1.0), (1.0, math.nan)):
        with pytest.raises(ValueError):
            prefetch_delay(q, load)


def test_load_time():
    assert load_time(0, 0) == 0.0
    assert load_time(10e9, 5e9) == 2.0
    assert load_time(1, 0) == math.inf
    with pytest.raises(ValueError):
        load_time(-1, 1)


def test_prefetch_at_and_hold_time():
    est = GapEstimator()
    assert prefetch_at(100.0, est, 2.0) == 100.0  # nothing known
    assert hold_time(est) == 30.0
    assert prefetch_at(100.0, est, 2.0, hint_s=10.0) == pytest.approx(107.0)  # sigma 0: q20 = the hint
    for _ in range(20):
        est.observe(10.0)
    assert est.quantile(0.2) == pytest.approx(10.0)
    assert prefetch_at(100.0, est, 2.0) == pytest.approx(107.0)
    assert prefetch_at(100.0, est, 10.0) == 100.0
    assert hold_time(est) == pytest.approx(30.0)  # 3 x 10 s: the floor
    for _ in range(20):
        est.observe(40.0)
    assert hold_time(est) == pytest.approx(3 * est.mean()) and hold_time(est) > 30.0


# the edges the tests above leave open (found by ``bench/mutation.py``)
@pytest.mark.parametrize("q", [0.0, 1.0, 1.5, -0.1])
def test_a_quantile_outside_0_1_is_refused(q):
    est = GapEstimator()
    est.observe(2.0)
    with pytest.raises(ValueError, match="a quantile is in"):  # (not NormalDist's own words for it)
        est.quantile(q)
    with pytest.raises(ValueError, match="a quantile is in"):
        est.prior.quantile(q)


def test_the_prior_alone_is_nothing_before_its_first_gap_then_a_lognormal_of_every_gap():
    prior = GapPrior()
    assert (prior.median(), prior.quantile(0.2), prior.mean_log, prior.var_log) == (None, None, None, None)
    for g in (1.0, math.e**2):  # log gaps 0 and 2: mean 1, variance 1
        prior.observe(g)
    assert (prior.mean_log, prior.var_log) == (pytest.approx(1.0), pytest.approx(1.0))
    assert prior.median() == pytest.approx(math.e)
    assert prior.quantile(0.2) == pytest.approx(math.exp(1.0 - 0.8416212335729143), rel=1e-12)
    assert prior.quantile(0.9) == pytest.approx(math.exp(1.0 + 1.2815515655446004), rel=1e-12)


def test_a_hint_sets_the_median_mean_and_hold_before_the_first_gap():
    est = GapEstimator()
    assert (est.median(), est.mean()) == (None, None)
    assert est.median(hint_s=50.0) == pytest.approx(50.0)
    assert est.mean(hint_s=50.0) == pytest.approx(50.0)  # sigma 0 (no prior): the mean is the median
    assert hold_time(est, hint_s=50.0) == pytest.approx(150.0)  # 3 x the expected gap, above the 30 s floor
    est.prior.observe(1.0)
    est.prior.observe(math.e**2)  # the prior's sigma: 1
    assert est.mean(hint_s=50.0) == pytest.approx(50.0 * math.exp(0.5))


def test_an_estimator_whose_prior_was_set_aside_estimates_from_its_own_gaps():
    est = GapEstimator()
    for g in (1.0, math.e**2):
        est.observe(g)
    est.prior = GapPrior()  # an empty prior weighs nothing: the session's own log-normal
    assert est.log_params() == (pytest.approx(1.0), pytest.approx(1.0))


@pytest.mark.parametrize("weight", [0.0, 0.5, 7.0])
def test_any_finite_prior_weight_from_zero_is_taken(weight):
    est = GapEstimator(weight=weight)
    est.observe(4.0)
    assert est.weight == weight


@pytest.mark.parametrize("weight", [-1.0, -math.inf, math.inf, math.nan])
def test_a_negative_or_unbounded_prior_weight_is_refused(weight):
    with pytest.raises(ValueError):
        GapEstimator(weight=weight)


def test_load_time_under_one_byte_a_second_and_its_refusals():
    assert load_time(10, 0.5) == 20.0
    for stored, rate in ((10, -1), (-1, 10), (math.nan, 10), (10, math.nan)):
        with pytest.raises(ValueError):
            load_time(stored, rate)
