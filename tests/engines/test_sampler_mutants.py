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
    filtered_probs,
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


def test_a_draw_at_zero_never_takes_a_token_of_no_probability_and_scales_to_the_total():
    probs = torch.tensor([[0.0, 0.5, 0.5], [0.25, 0.0, 0.75]])
    assert _draw(probs, torch.tensor([0.0, 0.25])).tolist() == [1, 2]  # (at a step: the token after it)
    assert _draw(torch.tensor([[1.0, 3.0]]), torch.tensor([0.5])).tolist() == [1]  # the point is u x the row's sum


def test_a_batch_answers_one_row_each_and_masks_of_other_rows_stay_beside_allowed_token_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 9.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    toks, lps = sample(logits, [greedy] * 3, [None] * 3)
    assert toks == [3, 0, 2] and lps == [None] * 3
    mask = torch.tensor([True, True, False, False])  # row 0: a grammar's mask
    params = [greedy, SamplingParams(temperature=0, allowed_token_ids=[1, 3]), greedy]
    assert sample(logits, params, [None] * 3, [mask, None, None])[0] == [1, 1, 2]


def test_min_tokens_leaves_the_end_token_to_a_row_whose_mask_allows_only_it():
    """A grammar that may only end (its mask: the end token alone) ends the row even before min_tokens; a mask that
    allows more keeps the end token banned."""
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0]] * 2)
    params = [SamplingParams(temperature=0, min_tokens=3)] * 2
    histories = [TokenHistory([1], p) for p in params]
    only_end = torch.tensor([False, False, True, False])
    more = torch.tensor([False, False, True, True])
    assert sample(logits, params, [None] * 2, [only_end, more], histories, eos_ids=[2])[0] == [2, 3]


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


def test_a_bitmask_shorter_than_the_vocabulary_allows_nothing_past_its_bits():
    logits = torch.zeros(2, 40)
    logits[:, 35] = 9.0  # the best token lies past the mask's 32 bits
    word = torch.tensor([(1 << 5) | (1 << 7)], dtype=torch.int32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    logits[0, 7] = 1.0
    toks, _ = sample(logits, params, [make_generator(p) for p in params], [word, word])
    assert toks[0] == 7 and toks[1] in (5, 7)


def test_top_k_of_1_keeps_one_token_beside_a_row_with_a_larger_k():
    scaled = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    probs = filtered_probs(scaled, torch.tensor([1.0, 3.0]), None, 3)
    assert (probs[0] > 0).tolist() == [True, False, False, False]
    assert (probs[1] > 0).tolist() == [True, True, True, False]


def test_top_p_drops_a_token_only_once_the_more_likely_ones_cover_more_than_top_p():
    """As the definition (``test_sampling_distributions``' reference) has it: two equally likely tokens of 0.5 each,
    top_p 0.5: the first covers exactly 0.5, not more, so the second stays."""
    probs = filtered_probs(torch.zeros(1, 2), torch.zeros(1), torch.tensor([0.5]), 0)
    assert probs.tolist() == [[0.5, 0.5]]
    assert (filtered_probs(torch.zeros(1, 2), torch.zeros(1), torch.tensor([0.4]), 0) > 0).sum() == 1


def test_min_tokens_with_nothing_to_ban_leaves_the_row_as_it_is():
    """min_tokens under ignore_eos and no stop ids bans no token: an empty ban (of integer ids) beside a row that
    bans some, and the rows sample as without it."""
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0]] * 2)
    params = [SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), SamplingParams(temperature=0, min_tokens=3)]
    histories = [TokenHistory([1], p) for p in params]
    assert sample(logits, params, [None] * 2, None, histories, eos_ids=[0])[0] == [0, 2]
    assert sample(logits[:1], params[:1], [None], None, histories[:1], eos_ids=[0])[0] == [0]
