"""Logit adjustments: ``logit_bias``, ``min_tokens``, repetition / frequency / presence penalties and ``min_p``.
The sampler's batched form against a plain float64 computation row by row (fresh random inputs each run) and
against transformers' own logits processors; whole greedy generations against transformers' ``generate`` and a
float64 reference loop over the transformers model. Then ``allowed_token_ids`` and the text options
(``include_stop_str_in_output``, ``skip_special_tokens``)."""

from collections import Counter

import pytest
import torch

from dualpath.core.errors import RequestError
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.sampler import TokenHistory, adjusted, filtered_probs, make_generator, sample

V = 97
EOS = (3, 11)


def reference(row: torch.Tensor, p: SamplingParams, prompt, output, mask=None) -> torch.Tensor:
    """One row adjusted as ``SamplingParams`` defines it, in float64, a token at a time (``mask``: a structured
    row's allowed tokens: its end tokens are held back only where it allows another)."""
    x = row.double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS))
    if len(output) < p.min_tokens and (mask is None or any(mask[t] for t in range(V) if t not in ends)):
        for t in ends:
            x[t] = float("-inf")
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= c * p.frequency_penalty + p.presence_penalty
    return x


def random_row(g: torch.Generator):
    """Parameters and a history for one row: each adjustment on or off at random."""

    def pick(on, value, off):
        return value if torch.rand(1, generator=g).item() < on else off

    prompt = torch.randint(0, V, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
    output = torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
    bias_ids = torch.randperm(V, generator=g)[: int(torch.randint(1, 6, (1,), generator=g))].tolist()
    p = SamplingParams(
        max_tokens=64,
        temperature=pick(0.5, 0.0, 0.8),
        presence_penalty=pick(0.5, float(torch.empty(1).uniform_(-2, 2, generator=g)), 0.0),
        frequency_penalty=pick(0.5, float(torch.empty(1).uniform_(-2, 2, generator=g)), 0.0),
        repetition_penalty=pick(0.5, float(torch.empty(1).uniform_(0.5, 2, generator=g)), 1.0),
        logit_bias=pick(0.5, tuple((t, float(torch.empty(1).uniform_(-100, 100, generator=g))) for t in bias_ids), ()),
        min_tokens=pick(0.3, 20, 0),
        stop_token_ids=pick(0.5, (5, 7), ()),
        ignore_eos=pick(0.2, True, False),
    )
    return p, prompt, output


def history(p, prompt, output):
    return TokenHistory(prompt, p, output) if p.needs_history else None


def test_adjusted_equals_a_float64_reference_row_by_row():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(20):
        rows = [random_row(g) for _ in range(6)]
        logits = torch.randn(6, V, generator=g) * 4
        masks = [None] * 6
        masks[0] = torch.rand(V, generator=g) < 0.5  # a structured row that may end or go on: held back
        masks[0][0] = True
        masks[1] = torch.zeros(V, dtype=torch.bool)  # one that may only end (its grammar is complete): not
        masks[1][list(EOS) + [5, 7]] = True
        got = adjusted(logits, [p for p, _, _ in rows], [history(*r) for r in rows], EOS, masks)
        want = torch.stack([reference(logits[i], p, pr, out, masks[i]) for i, (p, pr, out) in enumerate(rows)])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)  # float32 against float64


def test_rows_without_adjustments_are_untouched_and_nothing_is_copied_when_none_has_one():
    logits = torch.randn(3, V)
    plain = SamplingParams()
    assert adjusted(logits, [plain] * 3, [None] * 3, EOS) is logits
    p = SamplingParams(repetition_penalty=1.7, logit_bias=((4, 9.0),))
    got = adjusted(logits, [plain, p, plain], [None, TokenHistory([1, 2, 3], p), None], EOS)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2]) and not torch.equal(got[1], logits[1])


def test_repetition_penalty_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    for penalty in (0.6, 1.3, 2.0):
        ids = torch.randint(0, V, (40,))
        scores = torch.randn(1, V) * 3
        p = SamplingParams(repetition_penalty=penalty)
        got = adjusted(scores, [p], [TokenHistory(ids[:25].tolist(), p, ids[25:].tolist())], EOS)
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids[None], scores.clone())
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_min_p_keeps_the_tokens_transformers_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    for min_p in (0.0, 0.01, 0.1, 0.5, 1.0):
        scores = torch.randn(4, V) * 3
        want = (
            MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), scores.clone()) > float("-inf")
            if min_p > 0
            else torch.ones(4, V, dtype=torch.bool)
        )
        probs = filtered_probs(scores, torch.zeros(4), None, 0, torch.full((4,), min_p))
        assert torch.equal(probs > 0, want), min_p
        torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_min_p_with_top_k_and_top_p_in_transformers_order():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(1, V) * 2
    probs = filtered_probs(scores, torch.tensor([20.0]), torch.tensor([0.9]), 20, torch.tensor([0.05]))
    x = scores.clone()
    for warp in (TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
        x = warp(torch.zeros(1, 1, dtype=torch.long), x)
    assert torch.equal(probs > 0, x > float("-inf"))
    torch.testing.assert_close(probs, x.softmax(-1))


def test_greedy_and_sampled_rows_take_tokens_of_the_adjusted_distribution():
    logits = torch.randn(2, V)
    ban = SamplingParams(temperature=0, logit_bias=((int(logits[0].argmax()), -100.0),))
    boost = SamplingParams(temperature=1.0, seed=3, logit_bias=((42, 100.0),))
    toks, _ = sample(logits, [ban, boost], [None, make_generator(boost)])
    assert toks[0] == int(logits[0].topk(2).indices[1]) and toks[1] == 42


def test_min_tokens_holds_back_end_tokens_then_lets_them_through():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS[1]] = 10.0  # the model wants to stop
    logits[0, 6] = 9.0
    p = SamplingParams(temperature=0, min_tokens=2, max_tokens=8)
    h = TokenHistory([1, 2], p)
    seen = []
    for _ in range(3):
        tok, _ = sample(logits, [p], [None], histories=[h], eos_ids=EOS)
        seen.append(tok[0])
        h.add(tok[0])
    assert seen == [6, 6, EOS[1]]
    ignore = SamplingParams(temperature=0, min_tokens=2, max_tokens=8, ignore_eos=True)
    assert sample(logits, [ignore], [None], histories=[TokenHistory([1], ignore)], eos_ids=EOS)[0] == [EOS[1]]


def test_a_row_that_needs_its_history_without_one_is_an_error():
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(torch.randn(1, V), [SamplingParams(presence_penalty=1.0)], [make_generator(SamplingParams())])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(presence_penalty=2.1), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_p=-0.1), "min_p"),
        (dict(max_tokens=3, min_tokens=4), "min_tokens"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
        (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
        (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
    ],
)
def test_invalid_values_are_request_errors(kwargs, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_logit_bias_is_normalized_and_survives_the_wire():
    p = SamplingParams(logit_bias={9: 1, 2: -3.5}, repetition_penalty=1.2)
    assert p.logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams.from_dict(p.to_dict()) == p


# --- whole generations ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    from dualpath import LLM

    return LLM(str(tiny_dirs["llama"]), block_size=16)


@pytest.fixture(scope="module")
def hf(tiny_dirs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()


def hf_generate(hf, prompt, n, **kw):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_generation_equals_transformers(llm, hf):
    prompts = [[5, 6, 7, 8] * 6, list(range(30, 70))]
    for penalty in (1.5, 0.8):
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=penalty, ignore_eos=True)
        )
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_generate(
                hf, prompt, 24, repetition_penalty=penalty, eos_token_id=None, pad_token_id=0
            ), penalty
    plain = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert plain.token_ids != outs[0].token_ids or penalty == 1.0  # the penalty changed the answer


def test_min_tokens_generation_equals_transformers_min_new_tokens(llm, hf):
    prompt = list(range(40, 60))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop = free[0]  # the model's first token: made an end token, it ends the reply at once...
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,)))[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,), min_tokens=6))[0]
    want = hf_generate(
        hf, prompt, 12, min_new_tokens=6, eos_token_id=[stop, *llm.model_config.eos_token_ids], pad_token_id=0
    )
    assert held.token_ids == want and len(held.token_ids) >= 6 and stop not in held.token_ids[:6]  # ...held back


def test_penalties_and_bias_generation_equals_a_float64_reference_loop(llm, hf):
    """Everything at once, greedy, against the transformers model's logits adjusted by ``reference``."""
    prompt = [9, 9, 9, 12, 13, 14] * 4
    p = SamplingParams(
        temperature=0,
        max_tokens=20,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=((7, 3.0), (8, -2.0)),
    )
    got = llm.generate(prompt, p)[0].token_ids
    out = []
    with torch.no_grad():
        for _ in range(20):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference(logits, p, prompt, out).argmax()))
    assert got == out


def test_bias_out_of_the_models_vocabulary_is_refused(llm):
    with pytest.raises(RequestError) as e:
        llm.generate([1, 2, 3], SamplingParams(logit_bias=((llm.model_config.vocab_size, 1.0),)))
    assert e.value.field == "logit_bias"


def test_min_tokens_holds_back_stop_strings_in_the_engine(llm):
    prompt = list(range(40, 60))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = llm.tokenizer.decode(free.token_ids[:1])
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert early.text == "" and early.finish_reason == "stop"
    held = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=4)
    )[0]
    assert len(held.token_ids) >= 4 and held.token_ids == free.token_ids[: len(held.token_ids)]
    assert held.finish_reason == "stop" and held.text.startswith(stop * 3)


# --- token restrictions and text options --------------------------------------------------------------------------


def test_allowed_token_ids_restrict_greedy_and_sampled_rows(llm, hf):
    prompt = list(range(70, 90))
    allowed = (65, 66, 67, 32)
    greedy = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)
    )[0].token_ids
    out = []
    with torch.no_grad():  # the reference: transformers' logits, argmax over the allowed ids
        for _ in range(10):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(allowed[int(logits[list(allowed)].argmax())])
    assert greedy == out
    sampled = llm.generate(
        [prompt] * 4, SamplingParams(temperature=1.5, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    )
    assert all(set(o.token_ids) <= set(allowed) for o in sampled)
    assert len({t for o in sampled for t in o.token_ids}) > 1  # sampled, not stuck on one


def test_allowed_token_ids_and_min_tokens_never_leave_a_row_empty():
    logits = torch.randn(2, V)
    only_end = SamplingParams(temperature=0, min_tokens=3, allowed_token_ids=EOS)
    mixed = SamplingParams(temperature=0, min_tokens=3, allowed_token_ids=(EOS[0], 40))
    toks, _ = sample(
        logits,
        [only_end, mixed],
        [None, None],
        histories=[TokenHistory([1], only_end), TokenHistory([1], mixed)],
        eos_ids=EOS,
    )
    assert toks[0] in EOS and toks[1] == 40


def test_include_stop_str_and_skip_special_tokens_in_the_text(llm):
    prompt = list(range(40, 60))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    stop = llm.tokenizer.decode(free.token_ids[1:2])
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[stop]))[0].text
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].text
    assert kept == cut + stop and free.text.startswith(kept)
    eos = llm.model_config.eos_token_ids[0]
    forced = dict(temperature=0, max_tokens=1, logit_bias=((eos, 100.0),))
    assert llm.generate(prompt, SamplingParams(**forced))[0].text == ""
    special = llm.generate(prompt, SamplingParams(**forced, skip_special_tokens=False))[0]
    assert special.token_ids == [eos] and special.text == llm.tokenizer.decode([eos], skip_special_tokens=False) != ""


# --- bad words ----------------------------------------------------------------------------------------------------


def banned_by_words(words, output) -> set[int]:
    """The tokens that would make the reply end in one of ``words``, found by trying each (the brute force)."""
    return {
        t
        for t in range(V)
        for w in words
        if len(w) <= len(output) + 1 and tuple(list(output) + [t])[-len(w) :] == tuple(w)
    }


def test_bad_words_ban_exactly_the_tokens_that_would_complete_one():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(30):
        alphabet = torch.randperm(V, generator=g)[:4].tolist()  # few tokens: words often overlap the reply
        words = tuple(
            tuple(
                alphabet[int(i)]
                for i in torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
            )
            for _ in range(int(torch.randint(1, 5, (1,), generator=g)))
        )
        output = [
            alphabet[int(i)] for i in torch.randint(0, 4, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g)
        ]
        prompt = list(words[0][:-1]) * 3  # the prompt never counts: only the reply's tokens do
        p = SamplingParams(temperature=0, max_tokens=64, bad_words=words)
        h = TokenHistory(prompt, p, output[:2])
        for t in output[2:]:  # grown a token at a time, as a sequence grows it
            h.add(t)
        logits = torch.randn(2, V, generator=g)
        got = adjusted(logits, [SamplingParams(), p], [None, h], EOS)
        banned = banned_by_words(words, output)
        assert torch.equal(got[0], logits[0])
        assert {t for t in range(V) if got[1, t] == float("-inf")} == banned, (words, output)
        keep = [t for t in range(V) if t not in banned]
        assert torch.equal(got[1, keep], logits[1, keep])


def test_bad_words_are_checked_and_survive_the_wire():
    p = SamplingParams(bad_words=[[5, 6], (7,), (5, 6)])
    assert p.bad_words == ((5, 6), (7,)) and p.bad_word_context == 1 and p.needs_history
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams(bad_words=((7,), (8,))).bad_word_context == 0  # one-token words read no reply
    for bad, kw in (
        ([()], {}),
        ([[1] * 33], {}),
        ([[-1]], {}),
        ([[i] for i in range(129)], {}),
        ([[1]], dict(json_object=True)),
        ([[1]], dict(allowed_token_ids=(1, 2))),
    ):
        with pytest.raises(RequestError) as e:
            SamplingParams(bad_words=bad, **kw)
        assert e.value.field == "bad_words"


def test_bad_words_generation_equals_transformers_bad_words_ids(llm, hf):
    prompt = list(range(30, 70))  # the tiny model's greedy reply to it varies (to others it repeats a token)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    for words in (((free[5], free[6]),), ((free[2],), (free[5], free[6]), (free[8], free[9], free[10]))):
        # transformers matches the prompt's tail too; these words' prefixes do not end the prompt, so both agree
        assert all(tuple(prompt[-k:]) != w[:k] for w in words for k in range(1, len(w)))
        got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=words))[
            0
        ].token_ids
        want = hf_generate(hf, prompt, 16, bad_words_ids=[list(w) for w in words], eos_token_id=None, pad_token_id=0)
        assert got == want and got != free
        assert not any(tuple(got[i : i + len(w)]) == w for w in words for i in range(len(got)))
        if len(words) == 1:  # the reply is the free one until the word's first token, then turns away
            assert got[:6] == free[:6] and got[6] != free[6]
    with pytest.raises(RequestError, match="bad_words"):
        llm.generate(prompt, SamplingParams(bad_words=((llm.model_config.vocab_size,),)))


# --- prompt logprobs ----------------------------------------------------------------------------------------------


def check_prompt_logprobs(got, prompt, hf, k):
    """Each prompt token's logprob, rank and top-k against transformers' logits of the whole prompt (float64)."""
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert got[0] is None and len(got) == len(prompt)
    for p, lp in enumerate(got[1:]):
        want = ref[p, prompt[p + 1]].item()
        assert lp.token_id == prompt[p + 1] and abs(lp.logprob - want) < 1e-4
        assert lp.rank == int((ref[p] > want + 1e-6).sum()) + 1 or lp.rank == int((ref[p] > want - 1e-6).sum()) + 1
        top = ref[p].topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist() or k == 0
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(lp.top, top.values.tolist()))


def test_prompt_logprobs_equal_transformers_in_chunks(tiny_dirs, hf):
    from dualpath import LLM

    chunked = LLM(str(tiny_dirs["llama"]), block_size=16, max_num_batched_tokens=24)  # prompts split in chunks
    prompts = [list(range(30, 100)), [5, 6, 7, 8] * 9, [42, 43]]
    outs = chunked.generate(prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf, 3)
    assert chunked.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_prompt_logprobs_across_chunks_recomputes_and_gaps():
    """Chunks in order give the whole-prompt answer; a chunk computed again (preemption) adds nothing; a chunk past
    positions never computed (KV loaded from storage) is an error, not a list with holes."""
    from dualpath.engines.sampler import extend_prompt_logprobs

    head = torch.randn(8, V)
    hidden, prompt = torch.randn(10, 8), torch.randint(0, V, (10,)).tolist()
    whole: list = []
    extend_prompt_logprobs(whole, prompt, 0, hidden, lambda h: h @ head, 2)
    done: list = []
    for start, end in ((0, 4), (0, 4), (4, 7), (2, 9), (9, 10)):
        extend_prompt_logprobs(done, prompt, start, hidden[start:end], lambda h: h @ head, 2)
    assert len(whole) == 9 and [(x.token_id, x.rank, [t for t, _ in x.top]) for x in done] == [
        (x.token_id, x.rank, [t for t, _ in x.top]) for x in whole
    ]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(done, whole))
    extend_prompt_logprobs(done, prompt, 10, hidden[:1], lambda h: h @ head, 2)  # a decode step: nothing
    extend_prompt_logprobs(fresh := [], prompt, 9, hidden[:1], lambda h: h @ head, 2)  # the last prompt position
    assert len(done) == 9 and fresh == []
    with pytest.raises(RuntimeError, match="position 5"):
        extend_prompt_logprobs([], prompt, 5, hidden[5:8], lambda h: h @ head, 2)
