import pytest
import torch

from dualpath.errors import RequestError
from dualpath.sampling_params import SamplingParams
from engines.sampler import _filter, make_generator, sample


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


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.isinf(_filter(logits, 2, 1.0)[2:]).all() and not torch.isinf(_filter(logits, 2, 1.0)[:2]).any()
    kept = ~torch.isinf(_filter(logits, 0, 0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.25 covers it
    assert (~torch.isinf(_filter(logits, 0, 0.45))).tolist() == [True, False, False, False]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    p = SamplingParams(temperature=1.0, seed=3)
    g = make_generator(p)
    counts = torch.zeros(3)
    for _ in range(3000):
        t, _ = sample(probs.log()[None], [p], [g])
        counts[t[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.04)


def test_logprobs_of_chosen_and_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, lps = sample(logits, [SamplingParams(temperature=0, logprobs=2)], [None])
    ref = logits[0].log_softmax(-1)
    assert lps[0].token_id == 0 and abs(lps[0].logprob - ref[0].item()) < 1e-6
    assert [t for t, _ in lps[0].top] == [0, 1]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(logprobs=21), dict(stop=[""])])
def test_invalid_params_name_the_field(bad):
    with pytest.raises(RequestError) as e:
        SamplingParams(**bad)
    assert e.value.field == next(iter(bad))


def test_params_round_trip_through_dict():
    p = SamplingParams(max_tokens=5, stop=["a", "b"], stop_token_ids=[3], seed=1, logprobs=2)
    assert SamplingParams.from_dict(p.to_dict()) == p
