"""Replies that move between engines: a continuation (``SamplingParams.num_resumed_tokens``) is the rest of the
reply it continues, in the single-process reference (the disaggregated runtime must reproduce it); and the
client's move itself (``dualpath.client.RequestHandle``) against a scripted test double of the cluster: which
choices go on, as what, and how their events come back as one stream. The whole thing through real processes,
with a decode engine killed mid-reply, is in ``test_cluster.py``."""

import json
import threading
from dataclasses import replace

import pytest

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.client import EngineLost, RequestHandle, _Delivered
from dualpath.core.errors import DualPathError, RequestError
from dualpath.core.messages import TokenEvent

PROMPT = [(5 * i) % 97 + 40 for i in range(37)]
LETTERS = tuple(b"ab c")  # a small alphabet: stop strings and patterns recur in a random model's text
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=40, ignore_eos=True),
    # counts of the reply so far move every logit; EOS made likely, so min_tokens decides where it ends
    "penalized": SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=40,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        min_tokens=21,
        logit_bias=((EOS_ID, 9.0),),
    ),
    "schema": SamplingParams(
        temperature=0.7,
        seed=1,
        max_tokens=60,
        json_schema=json.dumps(
            {
                "type": "object",
                "properties": {"note": {"type": "string", "minLength": 16}, "n": {"type": "integer"}},
                "required": ["note", "n"],
            }
        ),
    ),
    "pattern": SamplingParams(temperature=1.0, seed=2, max_tokens=40, regex=r"(ab|c )+[0-9]{2,}"),
    "letters": SamplingParams(temperature=1.0, seed=9, max_tokens=60, allowed_token_ids=LETTERS),
}


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), block_size=16)


def continued(llm, params: SamplingParams, reply: list[int], cut: int):
    return llm.generate(PROMPT + reply[:cut], replace(params, num_resumed_tokens=cut))[0]


@pytest.mark.parametrize("case", CASES)
def test_a_continuation_is_the_rest_of_its_reply(llm, case):
    """Cut anywhere (after the first token, inside and at the end of a block, one before the end), the
    continuation's reply is the whole reply: same tokens, same end. Without the seeded generator skipping the
    resumed draws, the reply's counts in the penalties and min_tokens, or the grammar reading the resumed tokens,
    a case here fails (each checked by breaking it)."""
    params = CASES[case]
    whole = llm.generate(PROMPT, params)[0]
    n = len(whole.token_ids)
    assert n > 12, whole.token_ids
    for cut in sorted({c for c in (1, 9, 16, 17, n - 1) if c < n}):
        got = continued(llm, params, whole.token_ids, cut)
        assert got.token_ids == whole.token_ids, (case, cut)
        assert got.finish_reason == whole.finish_reason, (case, cut)
        assert got.prompt_token_ids == PROMPT


def test_a_stop_string_across_the_cut_still_ends_the_reply(llm):
    """A stop string whose first characters were resumed and whose last ones the continuation writes ends it where
    the whole reply ended (the stop-string reader has read the resumed text)."""
    plain = CASES["letters"]
    reply = llm.generate(PROMPT, plain)[0].token_ids
    text = bytes(reply).decode()
    found = 0
    for end in range(12, len(text)):
        stop = text[end - 3 : end]
        if text.find(stop) != end - 3:  # it must first occur here, or the reply ends before the cut
            continue
        with_stop = replace(plain, stop=(stop,), include_stop_str_in_output=True)
        whole = llm.generate(PROMPT, with_stop)[0]
        assert whole.text == text[:end] and whole.finish_reason == "stop"
        got = continued(llm, with_stop, reply, end - 2)  # two of the three characters resumed
        assert (got.text, got.token_ids, got.finish_reason) == (whole.text, whole.token_ids, "stop")
        found += 1
    assert found >= 3, text


def test_resumed_tokens_are_checked():
    with pytest.raises(RequestError, match=r"num_resumed_tokens must be in \[0, max_tokens\)"):
        SamplingParams(max_tokens=8, num_resumed_tokens=8)
    with pytest.raises(RequestError, match="one choice without prompt logprobs"):
        SamplingParams(max_tokens=8, num_resumed_tokens=2, n=2)
    with pytest.raises(RequestError, match="one choice without prompt logprobs"):
        SamplingParams(max_tokens=8, num_resumed_tokens=2, prompt_logprobs=0)
    p = SamplingParams(max_tokens=8, num_resumed_tokens=3)
    assert p.max_new_tokens == 5 and p.split_resumed([1, 2, 3, 4, 5]) == ([1, 2], [3, 4, 5])


# --- the client's move, against a scripted test double ---------------------------------------------------------
class ScriptedHandle:
    """Test double of a continuation's ``RequestHandle``: yields the events it was given."""

    def __init__(self, request_id: str, events: list[TokenEvent]):
        self.request_id, self.script, self.cancelled = request_id, events, False

    def events(self):
        yield from self.script

    def cancel(self):
        self.cancelled = True


class ScriptedClient:
    """Test double of ``ClusterClient`` for ``RequestHandle._move``: records what it is asked to start and answers
    each continuation with ``script(choice)``'s events."""

    def __init__(self, script):
        self.script, self.started, self.moved, self.labels = script, [], [], []
        self.lock = threading.Lock()

    def _start(self, tokens, params, request_id, mode, migrations, label=""):
        choice = int(request_id.rsplit("+", 1)[1])
        with self.lock:
            self.started.append((choice, tokens, params, mode, migrations))
            self.labels.append(label)
        return ScriptedHandle(request_id, self.script(choice))

    def _migrated(self, request_id, why, resumed):
        self.moved.append((request_id, resumed))


def delivered(tokens: list[int], ending: str = "", done: bool = False, cached: int = 0) -> _Delivered:
    d = _Delivered()
    for k, t in enumerate(tokens):
        d.note(
            TokenEvent(
                "r.0",
                t,
                ending=ending if k == len(tokens) - 1 else "",
                num_prompt_tokens=50 if k == 0 else 0,
                num_cached_tokens=cached,
                path="pe",
            )
        )
    if done:
        d.note(TokenEvent("r.0", finish_reason=ending or "stop", final=False))
    return d


def test_the_unfinished_choices_go_on_where_they_were_and_come_back_as_one_stream():
    """Four choices when the engine was lost: one finished, one whose last token ended it (its finish event lost
    with the engine: made here), one mid-reply, one with nothing yet. The last two go on as requests of their own
    (seed + choice, one choice, their tokens resumed; prompt logprobs only where none were delivered), their events
    renumbered as the request's, its usage its own, and only the very last event final."""
    params = SamplingParams(temperature=1.0, seed=10, max_tokens=30, n=4, prompt_logprobs=1)
    prompt = list(range(50))

    def script(choice):
        n_new = 5 if choice == 2 else 3
        toks = [
            TokenEvent(
                f"r+{choice}.0",
                100 + k,
                num_prompt_tokens=0 if k else 50 + 7 * (choice == 2),
                num_cached_tokens=48 + 16 * (choice == 2),
            )
            for k in range(n_new)
        ]
        return toks + [
            TokenEvent(
                f"r+{choice}.0",
                finish_reason="length",
                num_prompt_tokens=57 if choice == 2 else 50,
                num_cached_tokens=64 if choice == 2 else 48,
                path="de",
            )
        ]

    client = ScriptedClient(script)
    handle = RequestHandle(client, "r", prompt, params, "de", migrations=2, label="rollout-3")
    state = [delivered([1, 2], done=True), delivered([3, 4, 5], ending="length"), delivered([6] * 7), _Delivered()]
    out = list(handle._move(state, EngineLost("lost")))
    assert client.labels == ["rollout-3"] * 2  # an abort of its label ends the continuations too
    started = sorted(client.started, key=lambda s: s[0])
    assert [
        (c, t[50:], p.n, p.seed, p.num_resumed_tokens, p.prompt_logprobs, mode, m) for c, t, p, mode, m in started
    ] == [(2, [6] * 7, 1, 12, 7, None, "de", 1), (3, [], 1, 13, 0, 1, "de", 1)]
    assert all(t[:50] == prompt for _, t, *_ in started)
    assert client.moved == [("r", {2: 7, 3: 0})]
    assert out[0].finish_reason == "length" and out[0].index == 1 and not out[0].final  # made here
    assert (out[0].num_prompt_tokens, out[0].num_cached_tokens, out[0].path) == (50, 0, "pe")
    by_choice = {i: [e for e in out if e.index == i] for i in (2, 3)}
    assert [e.token_id for e in by_choice[2]] == [100, 101, 102, 103, 104, -1]
    assert [e.token_id for e in by_choice[3]] == [100, 101, 102, -1]
    assert [e.final for e in out] == [False] * (len(out) - 1) + [True]
    finishes = [e for e in out if e.finish_reason]
    assert sorted(e.index for e in finishes) == [1, 2, 3]
    # the continuations' numbers as the request's: its own 50 prompt tokens, at most all of them loaded
    assert {(e.num_prompt_tokens, e.num_cached_tokens) for e in finishes[1:]} == {(50, 48), (50, 50)}
    assert {(e.num_prompt_tokens, e.num_cached_tokens) for e in out if e.token_id >= 0 and e.num_prompt_tokens} == {
        (50, 48),
        (50, 50),
    }


def test_without_migrations_left_a_lost_engine_fails_the_request():
    client = ScriptedClient(lambda choice: [])
    handle = RequestHandle(client, "r", [1, 2, 3], SamplingParams(max_tokens=9), "", migrations=0)
    with pytest.raises(DualPathError, match="the decode engine failed"):
        list(handle._move([delivered([7])], EngineLost("request r: the decode engine failed mid-generation")))
    assert not client.started


def test_a_reply_let_go_of_mid_move_cancels_its_continuations():
    client = ScriptedClient(lambda choice: [TokenEvent("x", 5 + k) for k in range(10)])
    handle = RequestHandle(client, "r", [1, 2, 3], SamplingParams(max_tokens=30, n=2, seed=1), "", migrations=1)
    gen = handle._move([delivered([7]), delivered([8])], EngineLost("lost"))
    next(gen)
    gen.close()
    assert len(handle.moved) == 2 and all(h.cancelled for h in handle.moved)


def test_a_continuation_under_speculative_decoding_is_the_rest_of_its_reply(tiny_dirs, llm):
    """A speculative step draws once per token it keeps, so a seeded continuation skips as many draws as a plain
    one: the same reply, decoded with drafts (a repetitive prompt makes prompt lookup propose them)."""
    spec = LLM(
        str(tiny_dirs["llama"]),
        block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    prompt = [5, 6, 7, 8] * 10
    for params in (
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=21, max_tokens=40, ignore_eos=True),
    ):
        whole = llm.generate(prompt, params)[0]  # decoded plainly
        for cut in (3, 20):
            got = spec.generate(prompt + whole.token_ids[:cut], replace(params, num_resumed_tokens=cut))[0]
            assert got.token_ids == whole.token_ids, (params, cut)
    assert spec.engine.spec_stats["accepted"] > 0
