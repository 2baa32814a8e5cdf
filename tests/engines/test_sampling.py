import pytest
import torch

from dualpath.core.errors import RequestError
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.sampler import _draw, filtered_probs, make_generator, sample


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.8, seed=7)
    a, _ = sample(logits, [p] * 3, [make_generator(p) for _ in range(3)])
    b, _ = sample(logits[1:2], [p], [make_generator(p)])
    assert a[1] == b[0]
    draws = [sample(logits[:1], [p], [make_generator(p)])[0][0] for _ in range(5)]
    assert len(set(draws)) == 1


def test_greedy_picks_argmax():
    logits = torch.randn(4, 30)
    toks, _ = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert toks == logits.argmax(-1).tolist()


def kept(logits, top_k, top_p):
    """Which tokens ``filtered_probs`` keeps, in vocabulary order, for one row."""
    k_max = min(max(top_k, 0), logits.numel())
    probs = filtered_probs(
        logits[None], torch.tensor([float(top_k)]), torch.tensor([top_p]) if top_p < 1 else None, k_max
    )
    return probs[0] > 0


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert kept(logits, 2, 1.0).tolist() == [True, True, False, False]
    assert kept(logits, 0, 0.7).tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.25 covers it
    assert kept(logits, 0, 0.45).tolist() == [True, False, False, False]
    assert kept(logits, 3, 0.8).tolist() == [True, True, False, False]  # top-p over the top-3 distribution
    assert kept(torch.tensor([1.0, 3.0, 3.0, 0.0]), 1, 1.0).tolist() == [False, True, True, False]  # ties kept


def reference_kept(logits, top_k, top_p):
    """The filters' definition, one row, in float64: the k most likely and their ties, then the smallest set of
    most likely tokens whose predecessors do not yet cover top_p."""
    x = logits.double()
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        keep &= x >= torch.topk(x, top_k).values[-1]
    probs = torch.where(keep, x, torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
    before = torch.tensor([probs[probs > probs[i]].sum() for i in range(x.numel())])
    return keep & (before <= top_p)


@pytest.mark.parametrize("seed", range(20))
def test_batched_filters_match_their_definition(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=g) * 3
    top_k = [0, 1, 5, 40, 3, 60][seed % 6]
    top_p = [1.0, 0.9, 0.5, 0.99, 0.2, 0.75][seed % 6]
    for row in logits:
        assert kept(row, top_k, top_p).tolist() == reference_kept(row, top_k, top_p).tolist()


def test_a_draw_never_lands_on_a_dropped_token():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 5))
    u = torch.tensor([0.0, 0.4999, 0.7, 0.9999999, 1.0 - 2**-24])
    picked = _draw(filtered_probs(logits, torch.full((5,), 2.0), None, 2), u)
    assert picked.tolist() == [0, 0, 1, 1, 1]  # top-2: 0 takes 2/3 of the mass, 1 the rest
    assert _draw(filtered_probs(logits, torch.zeros(5), None, 0), u).tolist() == [0, 0, 1, 3, 3]
    # top-p leaves mass 0.9 unnormalized: a draw just under 1 lands on the last kept token, not the dropped one
    top = torch.tensor([0.0, 1.0 - 2**-24, 0.999999])
    assert _draw(filtered_probs(logits[:3], torch.zeros(3), torch.full((3,), 0.8), 0), top).tolist() == [0, 2, 2]
    # rows with and without top-k in one batch: top_k 0 and -1 mean no top-k
    mixed = filtered_probs(logits[:3], torch.tensor([2.0, 0.0, -1.0]), None, 2)
    assert (mixed > 0).tolist() == [[True, True, False, False]] + [[True] * 4] * 2


def test_a_batch_of_greedy_sampled_and_logprob_rows():
    """Greedy and sampled rows side by side, each with its own logprobs count: every row as it would be alone."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.7, seed=5, top_k=4),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, seed=9, top_p=0.8, logprobs=0),
    ]
    toks, lps = sample(logits, params, [make_generator(p) for p in params])
    for i, p in enumerate(params):
        alone, alone_lp = sample(logits[i : i + 1], [p], [make_generator(p)])
        assert toks[i] == alone[0] and lps[i] == alone_lp[0]
    assert toks[0] == int(logits[0].argmax()) and toks[2] == int(logits[2].argmax())
    assert toks[1] in logits[1].topk(4).indices.tolist()
    ref = logits.log_softmax(-1)
    assert [t for t, _ in lps[0].top] == ref[0].topk(3).indices.tolist()
    assert abs(lps[0].logprob - float(ref[0, toks[0]])) < 1e-6 and lps[3].top == () and lps[1] is None
    assert abs(lps[3].logprob - float(ref[3, toks[3]])) < 1e-6


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    p = SamplingParams(temperature=1.0, seed=3)
    g = make_generator(p)
    counts = torch.zeros(3)
    for _ in range(3000):
        t, _ = sample(probs.log()[None], [p], [g])
        counts[t[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.04)
    # with filters: top-p 0.8 keeps the first two, renormalized to 2/3 and 1/3
    p = SamplingParams(temperature=1.0, seed=4, top_p=0.8)
    g, counts = make_generator(p), torch.zeros(3)
    for t in sample(probs.log()[None].expand(3000, 3), [p] * 3000, [g] * 3000)[0]:
        counts[t] += 1
    assert counts[2] == 0 and torch.allclose(counts[:2] / 3000, torch.tensor([2 / 3, 1 / 3]), atol=0.04)


def test_logprobs_of_chosen_and_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, lps = sample(logits, [SamplingParams(temperature=0, logprobs=2)], [None])
    ref = logits[0].log_softmax(-1)
    assert lps[0].token_id == 0 and abs(lps[0].logprob - ref[0].item()) < 1e-6
    assert [t for t, _ in lps[0].top] == [0, 1]


@pytest.mark.parametrize(
    "bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(logprobs=21), dict(stop=[""])]
)
def test_invalid_params_name_the_field(bad):
    with pytest.raises(RequestError) as e:
        SamplingParams(**bad)
    assert e.value.field == next(iter(bad))


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=True),
        dict(n=True),
        dict(temperature=True),
        dict(seed=False),
        dict(logprobs=True),
        dict(top_k=2.0),
        dict(top_p="0.5"),
        dict(priority=True),
        dict(ignore_eos=1),
        dict(skip_special_tokens="yes"),
        dict(cache_salt=7),
        dict(stop=[3]),
        dict(stop_token_ids=[True]),
        dict(allowed_token_ids=[1.0]),
        dict(bad_words=[(True,)]),
        dict(logit_bias=[(5, True)]),
    ],
)
def test_a_value_of_another_type_is_refused_naming_the_field(bad):
    """A bool is no number (Python counts it an int), a number no bool, a string neither: never silently read."""
    with pytest.raises(RequestError) as e:
        SamplingParams(**bad)
    assert e.value.field == next(iter(bad)) and next(iter(bad)) in str(e.value)


def test_numbers_of_any_numeric_type_are_kept_as_plain_python_ones():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=1, max_tokens=np.int64(5), seed=np.int32(3), top_p=np.float32(0.5))
    assert (p.temperature, p.max_tokens, p.seed, p.top_p) == (1.0, 5, 3, 0.5)
    assert type(p.temperature) is float and type(p.max_tokens) is int and type(p.seed) is int


@pytest.mark.parametrize("bad", [dict(json_thinking="open"), dict(json_object=True, json_thinking="yes")])
def test_thinking_first_needs_json_output_and_a_known_mode(bad):
    with pytest.raises(RequestError, match="json_thinking") as e:
        SamplingParams(**bad)
    assert e.value.field == "response_format"


def test_params_round_trip_through_dict():
    """The wire form names only what differs from the defaults."""
    p = SamplingParams(max_tokens=5, stop=["a", "b"], stop_token_ids=[3], seed=1, logprobs=2)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert p.to_dict() == {"max_tokens": 5, "stop": ["a", "b"], "stop_token_ids": [3], "seed": 1, "logprobs": 2}
    assert SamplingParams().to_dict() == {} and SamplingParams(seed=0).to_dict() == {"seed": 0}


def test_the_params_cache_builds_each_set_once_and_tells_true_from_1():
    """The scheduler's ``ParamsCache``: one frozen object per parameter set; a bool is never served as the int it
    equals as a dict key (``max_tokens=True`` is refused, as ``SamplingParams`` refuses it); a set with an
    unhashable value is built each time; the cache is bounded."""
    from dualpath.core.sampling_params import ParamsCache

    cache = ParamsCache(capacity=2)
    one = cache.get({"max_tokens": 1})
    assert cache.get({"max_tokens": 1}) is one and one.max_tokens == 1
    with pytest.raises(RequestError, match="max_tokens"):
        cache.get({"max_tokens": True})
    with pytest.raises(RequestError, match="integer token ids"):
        cache.get({"stop_token_ids": [True]}) if cache.get({"stop_token_ids": [1]}) else None
    bias = {"logit_bias": [[3, 1.0]]}
    assert cache.get(bias) == cache.get(bias) and cache.get(bias) is not cache.get(bias)
    cache.get({"max_tokens": 2})
    assert cache.get({"max_tokens": 1}) is not one and len(cache._sets) <= 2


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA on the GPU machine (bench/gpu/run.sh)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(15))
def test_a_seeded_row_samples_the_same_whatever_its_batch(seed, device):
    """Batch independence, exactly: the filters a batch runs for its other rows leave a row's distribution as it
    would be alone (on a GPU too, where the kernels must not depend on the batch's size)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(5, 32000 if device == "cuda" else 300, generator=g) * 2).to(device)
    choices = [
        dict(temperature=0.9),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.1, top_p=0.85),
        dict(temperature=0.6, top_k=5, top_p=0.5),
        dict(temperature=0),
    ]
    params = [SamplingParams(seed=100 + i, **choices[(seed + i) % 5]) for i in range(5)]
    batch_gens, alone_gens = [make_generator(p) for p in params], [make_generator(p) for p in params]
    for _ in range(3):  # three steps: each request's generator advances alike batched and alone
        together = sample(logits, params, batch_gens)[0]
        apart = [sample(logits[i : i + 1], [p], [alone_gens[i]])[0][0] for i, p in enumerate(params)]
        assert together == apart
        logits = logits.roll(7, dims=1)
