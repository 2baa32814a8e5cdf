"""The sampler's pieces at the edges ``test_sampling`` and ``test_penalties`` leave open (found by
``bench/mutation.py``)."""

import pytest
import torch

from dualpath.core.errors import RequestError
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.sampler import (
    BadWords,
    TokenHistory,
    _draw,
    check_token_ids,
    make_generator,
    prompt_logprobs,
    sample,
)


def test_bad_words_ban_each_completion_once():
    words = BadWords(((5,), (1, 2), (1, 3), (7, 1, 4)))
    assert words.banned([]) == [5]
    assert words.banned([1]) == [5, 2, 3]
    assert words.banned([7, 1]) == [5, 2, 3, 4]  # shorter prefixes first
    assert words.banned([9, 9]) == [5]


def test_token_ids_a_request_names_must_be_in_the_vocabulary():
    check_token_ids(SamplingParams(), 10, [0, 9])
    check_token_ids(SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9], allowed_token_ids=[9]), 10)
    check_token_ids(SamplingParams(bad_words=[[8, 9]]), 10)
    for bad in ([-1, 3], [3, 10]):
        with pytest.raises(RequestError) as e:
            check_token_ids(SamplingParams(), 10, bad)
        assert e.value.field == "prompt"
    for field, params in (
        ("logit_bias", SamplingParams(logit_bias={10: 1.0})),
        ("stop_token_ids", SamplingParams(stop_token_ids=[10])),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 10])),
        ("bad_words", SamplingParams(bad_words=[[1], [2, 10]])),
    ):
        with pytest.raises(RequestError) as e:
            check_token_ids(params, 10)
        assert e.value.field == field


def test_a_generator_per_choice_from_the_seed_skipping_resumed_draws():
    assert make_generator(SamplingParams(temperature=0.0)) is None
    draws = [torch.rand(3, generator=make_generator(SamplingParams(seed=7), c)).tolist() for c in (0, 1)]
    assert draws[0] == torch.rand(3, generator=torch.Generator().manual_seed(7)).tolist()
    assert draws[1] == torch.rand(3, generator=torch.Generator().manual_seed(8)).tolist()
    resumed = make_generator(SamplingParams(seed=7, max_tokens=9, num_resumed_tokens=2))
    g = torch.Generator().manual_seed(7)
    torch.rand(1, generator=g), torch.rand(1, generator=g)
    assert torch.rand(1, generator=resumed).item() == torch.rand(1, generator=g).item()
    unseeded = [torch.rand(2, generator=make_generator(SamplingParams())).tolist() for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_a_history_counts_each_generated_token_past_its_first_slots():
    params = SamplingParams(repetition_penalty=1.2, bad_words=[[1, 2, 3]])
    h = TokenHistory([5, 3, 5], params, output_ids=list(range(40)) + [4, 4])
    ids, counts = h.tensors()
    assert (ids.dtype, counts.dtype, h.prompt.dtype) == (torch.int64, torch.float32, torch.int64)
    assert h.prompt.tolist() == [3, 5] and h.n == 42 and list(h.tail) == [4, 4]
    assert ids.tolist() == list(range(40)) and counts.tolist() == [1] * 4 + [3] + [1] * 35
    h.add(99)
    ids, counts = h.tensors()
    assert ids.tolist()[-1] == 99 and counts.tolist()[-1] == 1 and len(ids) == 41
    assert TokenHistory([1], SamplingParams(presence_penalty=0.5)).prompt is None
    assert TokenHistory([], params).prompt.dtype == torch.int64  # (an empty prompt too)
    assert TokenHistory.of([1], SamplingParams()) is None and TokenHistory.of([1], params).n == 0
    assert TokenHistory.of([1], params, [4, 4, 7]).n == 3  # a resumed reply's tokens count


def test_a_draw_at_zero_never_takes_a_token_of_no_probability():
    probs = torch.tensor([[0.0, 0.5, 0.5], [0.25, 0.0, 0.75]])
    assert _draw(probs, torch.tensor([0.0, 0.25])).tolist() == [1, 2]  # (at a step: the token after it)


def test_prompt_logprobs_rank_ties_and_passes():
    """Rank is 1 + the tokens strictly more likely (a tie does not count); each row's top-k and the chosen token's
    log-probability; any number of rows per pass gives the same."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 5.0], [2.0, 1.0, 0.0, -1.0]] * 2)
    ids = [2, 0, 3, 1, 3, 0]
    ref = logits.log_softmax(-1)
    for per_pass in (256, 2, 4):
        out = prompt_logprobs(lambda h: h, logits, ids, 2, rows_per_pass=per_pass)
        assert [(x.token_id, x.rank) for x in out] == [(2, 1), (0, 2), (3, 4), (1, 1), (3, 1), (0, 1)]
        assert [x.top for x in out][2] == ((0, float(ref[2, 0])), (1, float(ref[2, 1])))
        assert [round(x.logprob, 5) for x in out] == [round(float(ref[j, t]), 5) for j, t in enumerate(ids)]
        assert all(len(x.top) == 2 and x.top[0][1] >= x.top[1][1] for x in out)


def test_sampled_rows_logprobs_each_keep_their_own_top_count():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 0.0, 4.0, 2.0]])
    params = [
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3),
    ]
    toks, lps = sample(logits, params, [None] * 3)
    ref = logits.log_softmax(-1)
    assert toks == [3, 0, 2] and lps[1] is None
    assert lps[0].top == ((3, float(ref[0, 3])),) and lps[0].rank == 0 and lps[2].rank == 0
    assert lps[2].top == tuple((t, float(ref[2, t])) for t in (2, 3, 0))
