"""Context-free grammars (GBNF, vLLM's guided_grammar; Lark too), compiled by llguidance: random non-recursive
grammars against Python's ``re`` on the regular expression they spell, recursive ones against reference recognizers
(Python's own parser for arithmetic, a stack for brackets, ``json`` for a JSON grammar), refused grammars, no dead
ends, masks with the end token where a sentence may end, and whole generations of the tiny random model that are
sentences of their grammar."""

import ast
import json
import random
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.core.structured import Constraint, GrammarError, check, compile
from grammar_check import accepts, along, check_masks_along, completes, fullmatches, read, time_limit

ALPHABET = "abc\né("
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n]*
"""  # JSON (an object at the top) in GBNF


def gbnf(text: str, **kwargs) -> Constraint:
    return Constraint("grammar", text, **kwargs)


# --- random regular grammars against re ----------------------------------------------------------------------
def expression(rule: int, rules: int):
    """A strategy for (GBNF text, Python regex) of one expression of rule ``rule``, referring only to later rules
    (so the grammar is not recursive and spells a regular expression: each reference inlined). GBNF's ``.`` is any
    character but a newline, as llguidance reads it."""
    leaves = [
        st.sampled_from(
            [
                ('"a"', "a"),
                ('"ab"', "ab"),
                ('""', ""),
                ('"\\n"', "\\n"),
                ("[a-b]", "[a-b]"),
                ("[^a]", "[^a]"),
                (".", "[^\\n]"),
                ('"\\u00e9"', "\u00e9"),
            ]
        )
    ]
    if rule + 1 < rules:
        leaves.append(st.integers(rule + 1, rules - 1).map(lambda r: (f"r{r}", f"(?:{{r{r}}})")))
    base = st.one_of(*leaves)

    def grow(inner):
        pair = st.tuples(inner, inner)
        return st.one_of(
            pair.map(lambda p: (f"{p[0][0]} {p[1][0]}", p[0][1] + p[1][1])),
            pair.map(lambda p: (f"({p[0][0]} | {p[1][0]})", f"(?:{p[0][1]}|{p[1][1]})")),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{0,2}", "{2}", "{1,}"])).map(
                lambda t: (f"({t[0][0]}){t[1]}", f"(?:{t[0][1]}){t[1]}")
            ),
        )

    return st.recursive(base, grow, max_leaves=5)


@st.composite
def regular_grammars(draw):
    """(GBNF text, the Python regex it spells): 1-4 rules, each referring only to later ones."""
    n = draw(st.integers(1, 4))
    bodies = [draw(expression(i, n)) for i in range(n)]
    text = "\n".join(f"{'root' if i == 0 else f'r{i}'} ::= {g}" for i, (g, _) in enumerate(bodies))
    inlined = [""] * n
    for i in range(n - 1, -1, -1):
        rx = bodies[i][1]
        for j in range(i + 1, n):
            rx = rx.replace(f"{{r{j}}}", inlined[j])
        inlined[i] = rx
    return text, inlined[0]


def accepted_walks(c: Constraint, rng, n: int, max_len: int = 16) -> list[bytes]:
    """Up to ``n`` texts the constraint accepts, by random walks over the bytes its masks allow (one token a byte),
    ending where it may with probability 0.3."""
    out = []
    for _ in range(4 * n):
        matcher, walk = compile(c), bytearray()
        while len(walk) < max_len and not (matcher.is_accepting() and rng.random() < 0.3):
            mask = matcher.compute_bitmask()
            nxt = [b for b in range(256) if mask[b // 8] >> (b % 8) & 1]
            if not nxt:
                break
            walk.append(rng.choice(nxt))
            assert matcher.consume_token(walk[-1])
        if matcher.is_accepting():
            out.append(bytes(walk))
        if len(out) == n:
            break
    return out


@settings(max_examples=30, deadline=None)
@given(regular_grammars(), st.randoms(use_true_random=False))
@example(('root ::= (r1)* ("a"){2}\nr1 ::= ("a"){0,2}', "(?:(?:(?:a){0,2}))*(?:a){2}"), random.Random(0))
def test_random_regular_grammars_match_what_python_fullmatches(grammar, rng):
    """References (nullable ones too, under repetition), alternatives, repetition and classes accept only what the
    inlined regular expression matches: texts the grammar's masks lead to (random walks), and random ones. Not all
    of it: llguidance's lexer reads a rule without recursion as one token, as far as it goes (greedy), so ``r1*``
    with ``r1 ::= "a" "\\n" "a"*`` takes "a\\na" + "a\\n" as one token "a\\naa" and then fails (the regex matches)."""
    text, regex = grammar
    c = gbnf(text)
    try:
        with time_limit(1):
            check(c)
    except GrammarError as e:  # "" only, or a grammar llguidance loops on (two greedy tokens, "a"+ "a"+), or one
        # past its parser's item limit (an ambiguous repetition, ("a"{0,2})* "a"{2}): refused, with the reason
        assert (
            "only the empty string" in str(e)
            and re.fullmatch(regex, "")
            or "took longer than" in str(e)
            or "Too many items" in str(e)
        )
        return
    for s in accepted_walks(c, rng, 5):
        assert re.fullmatch(regex, s.decode()), (text, regex, s)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(300)]
    for s, got in zip(texts, fullmatches(c, texts)):
        assert not got or re.fullmatch(regex, s), (text, regex, s)


@pytest.mark.parametrize(
    "grammar, text, ok",
    [
        ('root ::= item ("," item)*\nitem ::= [a-z]+', "ab,c,def", True),
        ('root ::= ("a" | "b")* "c"', "abbac", True),
        ('root ::= r1*\nr1 ::= "a" "\\n" "a"*', "a\naa\n", False),  # greedy: "a\naa" is one token, "\n" no r1
        ('root ::= r1*\nr1 ::= "a" "\\n" "a"*', "a\naa", True),
    ],
)
def test_rules_without_recursion_are_read_greedily(grammar, text, ok):
    assert accepts(gbnf(grammar), text) == ok


# --- recursive grammars against reference recognizers ----------------------------------------------------------
ARITHMETIC = r"""
# integer arithmetic: precedence by rules, parentheses by recursion
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]* | "(" expr ")"
"""
BRACKETS = 'root ::= ("(" root? ")" | "[" root? "]" | "x")+'


def python_arithmetic(s: str) -> bool:
    """Python's own parser: integer literals (no leading zero), + - * / and parentheses, no unary operators."""
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(n, allowed) for n in ast.walk(tree)) and " " not in s


def balanced(s: str) -> bool:
    stack = []
    for c in s:
        if c in "([":
            stack.append(c)
        elif c in ")]":
            if not stack or stack.pop() != "(["[")]".index(c)]:
                return False
        elif c != "x":
            return False
    return not stack and bool(s)


@pytest.mark.parametrize(
    "grammar, reference, alphabet", [(ARITHMETIC, python_arithmetic, "129+*/()-"), (BRACKETS, balanced, "()[]x")]
)
def test_recursive_grammars_accept_what_a_reference_recognizer_does(grammar, reference, alphabet):
    """On random strings and on every prefix of the ones accepted: accepted exactly when the reference accepts,
    every prefix of an accepted string a live state, and the state may end exactly where the prefix is accepted."""
    c, rng = gbnf(grammar), random.Random(grammar)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    accepted = 0
    for s, got in zip(texts, fullmatches(c, texts)):
        assert got == reference(s), s
        if got and accepted < 60:
            accepted += 1
            states = along(c, s)
            assert len(states) == len(s) + 1, s
            assert [r.may_end for r in states[1:]] == [reference(s[:cut]) for cut in range(1, len(s) + 1)], s
    assert accepted > 50


@settings(max_examples=80, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=10,
    ),
    st.sampled_from([None, 1]),
    st.booleans(),
)
def test_a_json_grammar_accepts_what_json_dumps_writes(value, indent, ascii_only):
    """A JSON grammar in GBNF (strings with escapes, numbers with exponents, nesting): every object ``json.dumps``
    writes is a sentence; cut short it is a live prefix that may not end."""
    text = json.dumps({"v": value}, indent=indent, ensure_ascii=ascii_only).encode()
    assert completes(gbnf(JSON_GBNF), text)
    assert not read(gbnf(JSON_GBNF), text[:-1]).may_end


@pytest.mark.parametrize(
    "grammar, words",
    [
        ("root ::= x", "Rule 'x' not found"),
        ('root ::= "" | ("")*', "only the empty string"),
        ("root ::= [a-", "Unexpected end of input"),
        ('root ::= "abc', "Unexpected end of input"),
        ('root ::= ("a"', "Expected ')'"),
        ('root ::= "\\q"', "Invalid escape sequence \\q"),
        ("root ::= [z-a]", "invalid character class range"),
        ('root ::= "a"{3,2}', "range end must be >= start"),
        ('root "a"', "Expected ::="),
        ('root ::= "a" | @', "Expected name"),
        ('start: "a" | nope', 'unknown name: "nope"'),  # Lark syntax, read as it is
        (12, "a grammar is a string"),
    ],
)
def test_grammars_that_cannot_be_enforced_are_refused(grammar, words):
    with pytest.raises(GrammarError, match=re.escape(words)) as e:
        check(gbnf(grammar))
    assert e.value.field == "grammar" and str(e.value).startswith("grammar: ")


def test_a_grammar_llguidance_loops_on_is_refused_in_time():
    """llguidance 1.9 never comes back from the first mask of two greedy tokens of one language in a row (each
    ``r`` is one token, read as far as it goes: the first takes every "a"), taking memory as it goes: the check, in a
    process of its own, refuses it at its time limit, and the next check is answered (by a new checker)."""
    for grammar in ('root ::= r r\nr ::= "a"+', 'root ::= "x" r r\nr ::= "ab"+'):  # (the second: a walk's)
        with time_limit(1), pytest.raises(GrammarError, match="took longer than 1 s") as e:
            check(gbnf(grammar))
        assert e.value.field == "grammar"
    check(gbnf('root ::= r "," r\nr ::= "a"+'))  # a separator between them: fine


def test_left_recursion_ambiguity_and_lark_are_fine():
    """llguidance parses with Earley: left-recursive rules (which the old engine refused) and ambiguous grammars
    read as written, right recursion as deep as the text goes; a grammar in Lark's syntax is taken as it is."""
    assert (
        accepts(gbnf('root ::= root "+" "1" | "1"'), "1+1+1") and read(gbnf('root ::= root "+" "1" | "1"'), "+") is None
    )
    assert accepts(gbnf('root ::= "x" root | "y"'), "x" * 500 + "y")
    ambiguous = gbnf('root ::= ("(" root ")" | "(" root? ")" | "x")+')
    assert accepts(ambiguous, "(" * 40 + "x" + ")" * 40) and read(ambiguous, "(" * 40 + ")" * 41) is None
    lark = gbnf('start: item ("," item)*\nitem: /[a-z]+/')
    assert accepts(lark, "ab,c") and read(lark, "ab,,") is None
    assert fullmatches(gbnf('root ::= "\\u00e9" "\\x41" [\\u00e0-\\u00ff]'), ["éAà", "éAb"]) == [True, False]


def test_no_dead_ends():
    """A branch through a rule that derives nothing is never offered; a random walk over allowed bytes never
    reaches a state with no way on and no end."""
    dead = gbnf('root ::= "a" dead | "b" more\ndead ::= "q" dead\nmore ::= ("," [0-9])* "."?')
    assert read(dead, b"b,1.") is not None
    rng = random.Random(3)
    for grammar in (ARITHMETIC, BRACKETS, JSON_GBNF):
        for _ in range(30):
            matcher = compile(gbnf(grammar))
            for _ in range(40):
                mask = matcher.compute_bitmask()
                nexts = [b for b in range(256) if mask[b // 8] >> (b % 8) & 1]
                assert nexts or matcher.is_accepting()
                if not nexts:
                    break
                assert matcher.consume_token(rng.choice(nexts))


def test_a_grammar_inside_fixed_text_and_after_thinking():
    c = gbnf(BRACKETS, prefix="<", suffix=">", thinking="open")
    assert completes(c, b"hmm</think>\n<([x])>")
    assert read(c, b"</think><(x]>") is None


# --- masks and generations -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "(", "(x", "(x)", "(x)[", "x"])
def test_masks_allow_the_end_token_exactly_where_a_sentence_may_end(text):
    """Masks against a token-by-token check from the full state (every token read byte by byte)."""
    tokens = [bytes([b]) for b in range(256)] + [b"(x)", b"x)", b"[[", b"(]"]
    end = len(tokens)
    check_masks_along(gbnf(BRACKETS), tokens + [None], text.encode(), end + 1, end)
    assert read(gbnf(BRACKETS), text).may_end == balanced(text)


def test_tiny_model_outputs_are_sentences_of_their_grammar(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    stopped = 0
    for grammar in (ARITHMETIC, BRACKETS, 'root ::= ("yes" | "no") ("," [ ]? ("yes" | "no"))*'):
        for seed in range(2):
            for o in llm.generate(
                ["hello", "x y"], SamplingParams(temperature=1.0, seed=seed, max_tokens=24, grammar=grammar)
            ):
                ids = o.token_ids[:-1] if o.token_ids[-1] == EOS_ID else o.token_ids
                assert EOS_ID not in ids
                if o.finish_reason == "stop":
                    stopped += 1
                    assert accepts(gbnf(grammar), bytes(ids)), (grammar, bytes(ids))  # a token a byte
                else:
                    assert read(gbnf(grammar), bytes(ids)) is not None
    assert stopped >= 4


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='root::= "ab\\|()[]^-*+?{},0123.#\nxu', max_size=30))
def test_any_text_compiles_or_is_refused_with_a_grammar_error(text):
    try:
        with time_limit(2):
            check(gbnf(text))
    except GrammarError as e:
        assert e.field == "grammar"


@pytest.mark.parametrize(
    "grammar, text",
    [
        (JSON_GBNF, json.dumps({"k": 'a "quoted" wörd', "n": [1, -2.5e3, {"x": None}], "t": True}, indent=1)),
        ('root ::= "say: " [^\\n]* "\\n" ("more" [a-z ]*)?', "say: hello there, é!\nmore words"),
        ('root ::= "x" [a-z] [a-z] [0-9]+ [^0-9]*', "xqr12 fin"),
    ],
)
def test_masks_of_broad_states_equal_a_token_by_token_check(grammar, text):
    """States where many bytes lead on (a string's text, a free line): every mask along the text equals reading
    each token from the state (random multi-byte tokens over the grammar's bytes)."""
    rng = random.Random(7)
    alphabet = [bytes([b]) for b in b'ab "\\{}[]:,.\n-0123456789etrunlsfx'] + ["é".encode(), "ö".encode()]
    tokens = [bytes([b]) for b in range(256)] + sorted(
        {b"".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6))) for _ in range(3000)}
    )
    check_masks_along(gbnf(grammar), tokens + [None], text.encode(), len(tokens) + 1)
