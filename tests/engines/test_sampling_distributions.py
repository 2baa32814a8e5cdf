"""The sampler's draws follow temperature, top-k, top-p and min-p as their definitions say, checked by sampling many
times from known logits against a float64 reference written from the definitions (not from the sampler's code).

Each case draws N tokens (a batch of N rows, each with a generator of its own seed). A token's count is binomial:
the check allows each kept token ``5 sigma`` of deviation (sigma = sqrt(p (1 - p) / N)), so with the seeds unfixed
a correct sampler would fail a case with probability under 6 x 5.7e-7 (about 3e-6); the seeds are fixed, so the
run is deterministic. A dropped token must never be drawn. A temperature applied the wrong way (multiplied, not
divided), a top-k that drops the k-th token, a top-p or min-p on the wrong side of its threshold all move some
probability by far more than that."""

import math

import pytest
import torch

from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.sampler import sample

LOGITS = [2.0, 1.0, 0.5, 0.0, -0.5, -1.5]
N = 20_000


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The definitions, in float64: softmax(l / T); top-k keeps the k most likely (ties included); top-p keeps, in
    order of likelihood, each token the more likely ones have not already covered ``top_p`` of; min-p keeps the
    tokens at least ``min_p`` times as likely as the most likely; the kept ones renormalized at each step."""
    z = [v / temperature for v in logits]
    m = max(z)
    p = [math.exp(v - m) for v in z]
    keep = [True] * len(p)
    if top_k > 0:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, z)]
    p = norm([q if k else 0.0 for q, k in zip(p, keep)])
    if top_p < 1.0:
        covered = 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            if covered > top_p:
                keep[i] = False
            covered += p[i]
        p = norm([q if k else 0.0 for q, k in zip(p, keep)])
    if min_p > 0.0:
        top = max(p)
        p = norm([q if q >= min_p * top else 0.0 for q in p])
    return p


def norm(p):
    s = sum(p)
    return [q / s for q in p]


def drawn(params: SamplingParams) -> list[int]:
    logits = torch.tensor([LOGITS] * N, dtype=torch.float32)
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(N)]
    tokens, _ = sample(logits, [params] * N, generators)
    return [tokens.count(t) for t in range(len(LOGITS))]


CASES = [
    dict(temperature=0.5),
    dict(temperature=1.7),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=2.5, top_p=0.5),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("knobs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_draws_follow_the_definition(knobs):
    want = reference(LOGITS, **knobs)
    counts = drawn(SamplingParams(max_tokens=1, **knobs))
    for t, (c, p) in enumerate(zip(counts, want)):
        if p == 0.0:
            assert c == 0, f"token {t} is dropped by {knobs} but was drawn {c} times"
            continue
        sigma = math.sqrt(p * (1 - p) / N)
        assert abs(c / N - p) <= 5 * sigma, f"token {t}: {c / N:.4f} drawn, {p:.4f} expected ({knobs})"


def test_the_reference_is_what_the_cases_need():
    """The cases reach the regimes they are for: temperatures below 1 sharpen and above 1 flatten, and each filter
    drops something (else a broken filter would go unseen)."""
    base = reference(LOGITS)
    assert reference(LOGITS, temperature=0.5)[0] > base[0] > reference(LOGITS, temperature=1.7)[0]
    for knobs in CASES[2:]:
        assert 0.0 in reference(LOGITS, **knobs), knobs
