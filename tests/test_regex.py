"""Patterns as byte automata (vLLM's guided_regex / guided_choice): the automaton against Python's ``re`` (with
``re.ASCII``, whose classes it uses) on strings that match and on strings that do not, UTF-8 sequences against
every character of a range, refused syntax, masks with the model's end tokens where a match may end, and whole
generations of the tiny random model that match."""
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.errors import RequestError
from dualpath.grammar import Grammar
from dualpath.regex import Regex, RegexError, choice_pattern, utf8_sequences
from engines.guided import GrammarMasks, GuideError, Vocabulary

PATTERNS = [r"\d+", r"(yes|no|maybe)", r"[a-z]{2,4}@[a-z]+\.(com|org)", r"a*b?c{0,3}", r"[^\n\"]*", r"\w+ \s?\W",
            r".{1,3}é", r"(ab|a)(bc|c)*", r"[\u00e0-\u00ff\u4e00-\u9fff]+", r"^-?\d+(\.\d+)?$",
            r"(?P<pair>[A-F0-9]{2}:){2}x", r"a{,2}b", r"[]a-]+", r"[^]]", r"\x41\u00e9\.", r"a|", r"(|a)b",
            r"\(\d{3}\) \d{3}-\d{4}", r"[\U0001F600-\U0001F64F]{1,2}[^\x00-\x7f]?", r"(?:\[\d+(, \d+)*\])?x",
            r"[+*?]{2}\{\}", r"(a|b)*?c+?", r"\D\W\S", r"[\d\s-]+", r"(?i)(yes|no)[^a]", r"a(?i:b[c-e](?-i:f))g",
            r"(?s)x.{1,2}", r"(?im)^A\x62$"]
ALPHABET = "abcxyz019 .@-\n\"éà中\U0001F600:ABF]_()[],+*?{}\tYESNOfgCDG"


def matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_what_python_fullmatches(pattern):
    rx, rng = Regex(pattern), random.Random(pattern)
    positives = 0
    for _ in range(1500):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))
        assert rx.fullmatch(text.encode()) == matches(pattern, text), text
        positives += matches(pattern, text)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_matching_string_is_accepted_and_each_prefix_stays_alive(data):
    """hypothesis writes strings the pattern matches: the grammar accepts each, every prefix of its bytes is a live
    state, and it may end exactly where Python's ``re`` says the text matches."""
    pattern = data.draw(st.sampled_from(PATTERNS))
    text = data.draw(st.from_regex(pattern, fullmatch=True).filter(lambda t: matches(pattern, t)))  # ASCII classes
    g = Grammar.pattern(pattern)
    state, encoded = g.start, text.encode()
    for i, b in enumerate(encoded):
        state = g.step(state, b)
        assert state is not None, (pattern, text, i)
    assert Grammar.may_end(state)
    for cut in range(len(text)):  # at character boundaries, may_end agrees with re on the prefix
        part = text[:cut]
        assert Grammar.may_end(g.run(g.start, part.encode())) == matches(pattern, part)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=12))
def test_any_text_compiles_or_is_refused_with_a_regex_error(pattern):
    try:
        rx = Regex(pattern)
    except RegexError:
        return
    try:
        compiled = re.compile(re.sub(r"\(\?<(?=\w)", "(?P<", pattern), re.ASCII)  # JSON Schema's named groups too
    except re.error:
        pytest.fail(f"accepted {pattern!r}, which Python refuses")
    rng = random.Random(pattern)
    for _ in range(50):
        text = "".join(rng.choice(ALPHABET + pattern) for _ in range(rng.randint(0, 6)))
        assert rx.fullmatch(text.encode()) == (compiled.fullmatch(text) is not None), (pattern, text)


@pytest.mark.parametrize("lo, hi", [(0, 0x7F), (0x70, 0x90), (0x7F, 0x800), (0x7FF, 0x801), (0x123, 0x4567),
                                    (0xFFF0, 0x10010), (0xE000, 0xE0FF), (0x10FF00, 0x10FFFF)])
def test_utf8_sequences_spell_each_character_of_a_range_exactly_once(lo, hi):
    seqs = utf8_sequences(lo, hi)
    spelled = sum(1 for c in range(lo, hi + 1) for s in seqs if _spells(s, chr(c).encode()))
    assert spelled == hi - lo + 1
    assert sum(_size(s) for s in seqs) == hi - lo + 1  # and nothing else


def _spells(seq, data: bytes) -> bool:
    return len(seq) == len(data) and all(a <= b <= z for (a, z), b in zip(seq, data))


def _size(seq) -> int:
    n = 1
    for a, z in seq:
        n *= z - a + 1
    return n


@pytest.mark.parametrize("pattern, words", [
    ("(a", "unterminated group"), ("a)", "unbalanced"), (r"\1", "back-reference"), ("(?=a)", "look-ahead"),
    ("(?<!a)b", "look-behind"), ("(?x)a", "inline flag x"),
    ("a(?i)b", "global flags only at the pattern's start"), ("(?Q)a", "inline flags"), ("a**", "multiple repeat"), (r"\bx", "word boundar"),
    ("a{3,2}", "min repeat greater"), ("[b-a]", "bad character range"), ("*a", "nothing to repeat"),
    ("a^", "only at the pattern's start"), ("$a", "only at the pattern's end"), ("(?P=x)", "back-reference"),
    ("a{1001}", "repeat counts above"), (r"[^\s\S]", "matches nothing"),
    ("a*+", "possessive"), ("(?>a)", "atomic"), ("[a", "unterminated character set"), (r"\q", "escape"),
    (r"\x4", "bad escape"), ("(" * 40 + ")" * 40 + "a", "nested"), ("(.{1000}){30}", "too large"),
])
def test_patterns_that_cannot_be_enforced_are_refused(pattern, words):
    with pytest.raises(RegexError, match=words) as e:
        Regex(pattern)
    assert isinstance(e.value, RequestError) and e.value.field == "regex"


def test_a_reply_must_be_more_than_the_empty_string():
    for pattern in ("", "(a?){0,3}?".replace("a?", "")):
        with pytest.raises(RegexError, match="only the empty string"):
            Grammar.pattern(pattern)
    assert Regex("").fullmatch(b"") and not Regex("").fullmatch(b"a")  # inside a JSON string it is a rule


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=6).filter(lambda s: s.isprintable()), min_size=1, max_size=5))
def test_a_choice_matches_exactly_its_strings(choices):
    if choices == [""] * len(choices):
        with pytest.raises(RegexError):
            Grammar.pattern(choice_pattern(choices))
        return
    rx = Regex(choice_pattern(choices))
    for c in choices:
        assert rx.fullmatch(c.encode())
    for other in ("".join(choices) + "x", "x" + choices[0], choices[0][:-1]):
        assert rx.fullmatch(other.encode()) == (other in choices)


def test_a_pattern_inside_fixed_text_and_after_thinking():
    g = Grammar.pattern(r"\d+", prefix=b"<n>", suffix=b"</n>")
    assert Grammar.complete(g.run(g.start, b"<n>42</n>"))
    assert g.run(g.start, b"<n></n>") is None and g.run(g.start, b"<n>4x") is None
    assert not Grammar.may_end(g.run(g.start, b"<n>42"))  # the suffix is still due
    t = Grammar.pattern("(yes|no)", thinking="open")
    state = t.run(t.start, b"maybe yes? </think>\n\nyes")
    assert Grammar.complete(state)
    assert t.run(t.start, b"</think>maybe") is None


# --- masks and end tokens ------------------------------------------------------------------------------------

END = 300  # the toy vocabulary's end token (no bytes)


def toy() -> tuple[list, Vocabulary]:
    vocab = [bytes([b]) for b in range(256)] + [b"12", b"345", b"1a", b"ye", b"yes", b"no ", b"\xc3\xa9", b"\xc3",
                                                b"\xa9x"]
    vocab += [None] * (END + 1 - len(vocab))
    return vocab, Vocabulary(vocab, END + 4, end_ids=[END, 10**6])


@pytest.mark.parametrize("pattern, text", [(r"\d+", b"12345"), ("(yes|yesno|no)", b"yesno"), (r"é\d?x", b"\xc3\xa91x"),
                                           (r"[^\n]{0,3}", b"abc")])
def test_masks_allow_the_end_token_exactly_where_the_match_may_end_or_read_on(pattern, text):
    vocab, v = toy()
    g = Grammar.pattern(pattern)
    masks = GrammarMasks(g, v, "cpu")
    state = g.start
    for i in range(len(text) + 1):
        want = [t is not None and g.run(state, t) is not None for t in vocab] + [False] * (v.width - len(vocab))
        want[END] = Grammar.may_end(state) and not Grammar.complete(state)
        assert torch.equal(masks.mask(state), torch.tensor(want)), (pattern, text[:i])
        if i < len(text):
            state = g.step(state, text[i])


def test_a_guide_ends_on_the_end_token_only_where_the_match_may_end():
    vocab, v = toy()
    masks = GrammarMasks(Grammar.pattern(r"\d+"), v, "cpu")
    guide = masks.guide()
    with pytest.raises(GuideError):
        guide.advance(END)  # nothing matched yet
    guide.advance(vocab.index(b"12"))
    assert not guide.complete and guide.mask()[END]
    guide.advance(END)
    assert guide.complete
    choice = GrammarMasks(Grammar.pattern("(yes|no)"), v, "cpu").guide()
    choice.advance(vocab.index(b"yes"))
    assert choice.complete  # nothing can follow: it ends without the end token
    assert not choice.mask().any()


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
                    assert Grammar.pattern(pattern).run(Grammar.pattern(pattern).start, data) is not None
    assert stopped >= 8 and by_end_token >= 2  # \d+ reads on until the model ends it
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                                        regex=choice_pattern(["red", "green", "blue (dark)"])))
    assert all(o.text in ("red", "green", "blue (dark)") and o.finish_reason == "stop" for o in outs)


def test_min_tokens_holds_back_the_end_a_pattern_allows_until_it_is_reached(tiny_dirs):
    """Under ``\\d+`` the end token is allowed after every digit; with ``min_tokens`` it is held back until that many
    tokens are out. Where only an end may follow (a choice spelled out) the reply ends all the same."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    prompts = ["hello", "x y", "a", "b"]
    free = [o for seed in range(3) for o in llm.generate(prompts, SamplingParams(
        temperature=1.0, seed=seed, max_tokens=24, regex=r"\d+"))]
    assert any(o.token_ids[-1] == EOS_ID and len(o.token_ids) < 7 for o in free)  # the test means something
    for o in (o for seed in range(3) for o in llm.generate(prompts, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=24, regex=r"\d+", min_tokens=6))):
        assert len(o.token_ids) >= 6 and EOS_ID not in o.token_ids[:6] and o.text.isdigit(), o.token_ids
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=20, min_tokens=10,
                                                regex=choice_pattern(["red", "green"])))
    assert all(o.text in ("red", "green") and o.finish_reason == "stop" for o in outs)


def test_sampling_params_take_one_constraint():
    with pytest.raises(RequestError, match="exclude each other"):
        SamplingParams(regex="a", json_object=True)
    assert SamplingParams(regex="a").structured
    assert SamplingParams.from_dict(SamplingParams(regex="a+", json_thinking="open").to_dict()).regex == "a+"
