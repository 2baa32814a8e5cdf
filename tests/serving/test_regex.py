"""Patterns (vLLM's guided_regex / guided_choice), compiled by llguidance: what they match against Python's ``re``
(with ``re.ASCII``, whose classes they use) on strings that match and on strings that do not, refused syntax, masks
with the model's end tokens where a match may end, and whole generations of the tiny random model that match."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.core.errors import RequestError
from dualpath.core.structured import Constraint, GrammarError, check, choice_pattern
from dualpath.engines.guided import GuideError
from grammar_check import allowed, along, check_masks_along, completes, fullmatches, read, toy_guide

# Python's syntax where Rust's regex (llguidance's) reads it alike; (?P<name>...) groups, lazy quantifiers, inline
# flags for the pattern or a group, ^ and $ at the ends
PATTERNS = [
    r"\d+",
    r"(yes|no|maybe)",
    r"[a-z]{2,4}@[a-z]+\.(com|org)",
    r"a*b?c{0,3}",
    r"[^\n\"]*",
    r"\w+ \s?\W",
    r".{1,3}é",
    r"(ab|a)(bc|c)*",
    r"[\u00e0-\u00ff\u4e00-\u9fff]+",
    r"^-?\d+(\.\d+)?$",
    r"(?P<pair>[A-F0-9]{2}:){2}x",
    r"a{0,2}b",
    r"[]a-]+",
    r"[^]]",
    r"\x41\u00e9\.",
    r"a|",
    r"(|a)b",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[\U0001F600-\U0001F64F]{1,2}[^\x00-\x7f]?",
    r"(?:\[\d+(, \d+)*\])?x",
    r"[+*?]{2}\{\}",
    r"(a|b)*?c+?",
    r"\D\W\S",
    r"[\d\s-]+",
    r"(?i)(yes|no)[^a]",
    r"a(?i:b[c-e](?-i:f))g",
    r"(?s)x.{1,2}",
    r"(?i)A\x62",
]
ALPHABET = 'abcxyz019 .@-\n"éà中\U0001f600:ABF]_()[],+*?{}\tYESNOfgCDG'


def matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


def regex(pattern: str, **kwargs) -> Constraint:
    return Constraint("regex", pattern, **kwargs)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_what_python_fullmatches(pattern):
    rng = random.Random(pattern)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(1500)]
    for text, got in zip(texts, fullmatches(regex(pattern), texts)):
        assert got == matches(pattern, text), text


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_matching_string_is_accepted_and_each_prefix_stays_alive(data):
    """hypothesis writes strings the pattern matches: the constraint reads each, every prefix of its bytes is a
    live state, and it may end exactly where Python's ``re`` says the text matches."""
    pattern = data.draw(st.sampled_from(PATTERNS))
    text = data.draw(st.from_regex(pattern, fullmatch=True).filter(lambda t: matches(pattern, t)))  # ASCII classes
    states = along(regex(pattern), text)
    assert len(states) == len(text.encode()) + 1, (pattern, text)
    assert states[-1].may_end
    for cut in range(len(text)):  # at character boundaries, may_end agrees with re on the prefix
        assert states[len(text[:cut].encode())].may_end == matches(pattern, text[:cut])


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=12))
def test_any_text_compiles_or_is_refused_with_a_regex_error(pattern):
    try:
        check(regex(pattern))
    except GrammarError as e:
        assert e.field == "regex" and str(e).startswith("regex: ")


@pytest.mark.parametrize(
    "pattern, words",
    [
        ("(a", "unclosed group"),
        ("a)", "unopened group"),
        (r"(a)\1", "backreferences are not supported"),
        ("(?=a)", "look-around"),
        ("(?<!a)b", "look-around"),
        ("(?Q)a", "unrecognized flag"),
        (r"\bx", "lookarounds not supported"),
        ("a{3,2}", "invalid repetition count range"),
        ("[b-a]", "invalid character class range"),
        ("*a", "repetition operator missing expression"),
        ("a^", "lookarounds not supported"),
        ("$a", "lookarounds not supported"),
        ("(?P=x)", "unrecognized flag"),
        (r"[^\s\S]", "matches nothing"),
        ("(?>a)", "unrecognized flag"),
        ("[a", "unclosed character class"),
        (r"\q", "unrecognized escape sequence"),
        (r"\x4", "incomplete escape sequence"),
        ("a{,2}", "repetition quantifier expects a valid decimal"),  # Python's {,n}: write {0,n}
    ],
)
def test_patterns_that_cannot_be_enforced_are_refused(pattern, words):
    with pytest.raises(GrammarError, match=re.escape(words)) as e:
        check(regex(pattern))
    assert isinstance(e.value, RequestError) and e.value.field == "regex"


def test_a_reply_must_be_more_than_the_empty_string():
    for pattern in ("", "(){0,3}"):
        with pytest.raises(GrammarError, match="only the empty string"):
            check(regex(pattern))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=6).filter(lambda s: s.isprintable()), min_size=1, max_size=5))
def test_a_choice_matches_exactly_its_strings(choices):
    if choices == [""] * len(choices):
        with pytest.raises(GrammarError):
            check(regex(choice_pattern(choices)))
        return
    c = regex(choice_pattern(choices))
    assert all(fullmatches(c, [x for x in choices if x]))
    others = ["".join(choices) + "x", "x" + choices[0], choices[0][:-1]]
    assert fullmatches(c, others) == [other in choices for other in others]


def test_a_pattern_inside_fixed_text_and_after_thinking():
    c = regex(r"\d+", prefix="<n>", suffix="</n>")
    assert completes(c, b"<n>42</n>")
    assert read(c, b"<n></n>") is None and read(c, b"<n>4x") is None
    assert not read(c, b"<n>42").may_end  # the suffix is still due
    t = regex("(yes|no)", thinking="open")
    assert completes(t, b"maybe yes? </think>\n\nyes")
    assert read(t, b"</think>maybe") is None


# --- masks and end tokens ------------------------------------------------------------------------------------

END = 300  # the toy vocabulary's end token (no bytes)


def toy() -> list:
    vocab = [bytes([b]) for b in range(256)] + [
        b"12",
        b"345",
        b"1a",
        b"ye",
        b"yes",
        b"no ",
        b"\xc3\xa9",
        b"\xc3",
        b"\xa9x",
    ]
    return vocab + [None] * (END + 1 - len(vocab))


@pytest.mark.parametrize(
    "pattern, text",
    [(r"\d+", b"12345"), ("(yes|yesno|no)", b"yesno"), (r"é\d?x", b"\xc3\xa91x"), (r"[^\n]{0,3}", b"abc")],
)
def test_masks_allow_the_end_token_exactly_where_the_match_may_end_or_read_on(pattern, text):
    check_masks_along(regex(pattern), toy(), text, END + 4, END)


def test_a_guide_ends_on_the_end_token_only_where_the_match_may_end():
    vocab = toy()
    guide = toy_guide(regex(r"\d+"), vocab, END + 4, [END])
    with pytest.raises(GuideError):
        guide.advance(END)  # nothing matched yet
    guide = toy_guide(regex(r"\d+"), vocab, END + 4, [END])
    guide.advance(vocab.index(b"12"))
    assert not guide.complete and allowed(guide, END + 4)[END]
    guide.advance(END)
    assert guide.complete
    choice = toy_guide(regex("(yes|no)"), vocab, END + 4, [END])
    choice.advance(vocab.index(b"yes"))
    assert choice.complete  # nothing can follow: it ends without the end token
    assert allowed(choice, END + 4).nonzero().flatten().tolist() == [END]  # (were it asked for one more token)


# --- whole generations -----------------------------------------------------------------------------------------


def test_tiny_model_outputs_match_their_patterns(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    stopped, by_end_token = 0, 0
    for pattern in (r"\d+", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"[A-Z][a-z]*( [a-z]+){0,3}\.", r"-?\d{1,3}"):
        for seed in range(2):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, regex=pattern)
            for o in llm.generate(["hello", "x y"], params):
                by_end_token += o.token_ids[-1] == EOS_ID
                ids = o.token_ids[:-1] if o.token_ids[-1] == EOS_ID else o.token_ids
                assert EOS_ID not in ids
                data = bytes(ids)  # the tiny tokenizer: one token per byte
                if o.finish_reason == "stop":
                    stopped += 1
                    assert matches(pattern, data.decode()), (pattern, data)
                else:
                    assert read(Constraint("regex", pattern), data) is not None
    assert stopped >= 8 and by_end_token >= 2  # \d+ reads on until the model ends it
    outs = llm.generate(
        ["a", "b", "c"],
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, regex=choice_pattern(["red", "green", "blue (dark)"])),
    )
    assert all(o.text in ("red", "green", "blue (dark)") and o.finish_reason == "stop" for o in outs)


def test_min_tokens_holds_back_the_end_a_pattern_allows_until_it_is_reached(tiny_dirs):
    """Under ``\\d+`` the end token is allowed after every digit; with ``min_tokens`` it is held back until that many
    tokens are out. Where only an end may follow (a choice spelled out) the reply ends all the same."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    prompts = ["hello", "x y", "a", "b"]
    free = [
        o
        for seed in range(3)
        for o in llm.generate(prompts, SamplingParams(temperature=1.0, seed=seed, max_tokens=24, regex=r"\d+"))
    ]
    assert any(o.token_ids[-1] == EOS_ID and len(o.token_ids) < 7 for o in free)  # the test means something
    for o in (
        o
        for seed in range(3)
        for o in llm.generate(
            prompts, SamplingParams(temperature=1.0, seed=seed, max_tokens=24, regex=r"\d+", min_tokens=6)
        )
    ):
        assert len(o.token_ids) >= 6 and EOS_ID not in o.token_ids[:6] and o.text.isdigit(), o.token_ids
    outs = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, min_tokens=10, regex=choice_pattern(["red", "green"])),
    )
    assert all(o.text in ("red", "green") and o.finish_reason == "stop" for o in outs)


def test_sampling_params_take_one_constraint():
    with pytest.raises(RequestError, match="exclude each other"):
        SamplingParams(regex="a", json_object=True)
    assert SamplingParams(regex="a").structured
    assert SamplingParams.from_dict(SamplingParams(regex="a+", json_thinking="open").to_dict()).regex == "a+"
