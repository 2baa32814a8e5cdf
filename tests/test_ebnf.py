"""Context-free grammars (GBNF, vLLM's guided_grammar) as byte pushdown automata: random non-recursive grammars
against Python's ``re`` on the regular expression they spell, recursive ones against reference recognizers
(Python's own parser for arithmetic, a stack for brackets, ``json`` for a JSON grammar), refused grammars, no dead
ends, shallow stacks for right recursion, masks with the end token where a sentence may end, and whole
generations of the tiny random model that are sentences of their grammar."""
import ast
import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.ebnf import JSON_GBNF, Cfg, EbnfError
from dualpath.grammar import Grammar
from dualpath.regex import Regex
from engines.guided import GrammarMasks, Vocabulary

ALPHABET = "abc\né("


# --- random regular grammars against re ----------------------------------------------------------------------
def expression(rule: int, rules: int):
    """A strategy for (GBNF text, Python regex) of one expression of rule ``rule``, referring only to later rules
    (so the grammar is not recursive and spells a regular expression: each reference inlined)."""
    leaves = [st.sampled_from([('"a"', "a"), ('"ab"', "ab"), ('""', ""), ('"\\n"', "\\n"), ("[a-b]", "[a-b]"),
                               ("[^a]", "[^a]"), (".", "[\\s\\S]"), ('"\\u00e9"', "\u00e9")])]
    if rule + 1 < rules:
        leaves.append(st.integers(rule + 1, rules - 1).map(lambda r: (f"r{r}", f"(?:{{r{r}}})")))
    base = st.one_of(*leaves)

    def grow(inner):
        pair = st.tuples(inner, inner)
        return st.one_of(
            pair.map(lambda p: (f"{p[0][0]} {p[1][0]}", p[0][1] + p[1][1])),
            pair.map(lambda p: (f"({p[0][0]} | {p[1][0]})", f"(?:{p[0][1]}|{p[1][1]})")),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{0,2}", "{2}", "{1,}"])).map(
                lambda t: (f"({t[0][0]}){t[1]}", f"(?:{t[0][1]}){t[1]}")))
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


def accepted_walks(reference: Regex, rng, n: int, max_len: int = 16) -> list[bytes]:
    """Up to ``n`` strings the reference automaton accepts, by random walks over it. (Hypothesis's ``from_regex``
    keeps only what ``re.fullmatch`` accepts, and ``re`` backtracks exponentially on nested repeats: one example
    once took over 20 minutes.)"""
    out = []
    for _ in range(20 * n):
        p, walk = 0, bytearray()
        while len(walk) < max_len and reference.follow[p] and not (p in reference.accepting and rng.random() < 0.3):
            p = rng.choice(sorted(reference.follow[p]))
            walk.append(rng.choice([b for b in range(256) if reference.masks[p] >> b & 1]))
        if p in reference.accepting:
            out.append(bytes(walk))
        if len(out) == n:
            break
    return out


@settings(max_examples=75, deadline=None)
@given(regular_grammars(), st.randoms(use_true_random=False))
def test_random_regular_grammars_match_what_python_fullmatches(grammar, rng):
    """References (nullable ones too, under repetition), alternatives, repetition and classes, read through the
    pushdown automaton, accept exactly what the inlined regular expression matches, on strings the regex matches
    (random walks over its automaton) and on random ones. The reference is the regex's position automaton
    (``dualpath.regex``, itself checked against Python's ``re`` in test_regex): ``re`` backtracks exponentially on
    nested repeats of what may be empty."""
    text, regex = grammar
    reference = Regex(regex)
    try:
        cfg = Cfg(text)
    except EbnfError as e:
        assert "only the empty string" in str(e) and reference.fullmatch(b"")  # the one refusal possible here
        return
    for s in accepted_walks(reference, rng, 5):
        assert cfg.fullmatch(s), (text, regex, s)
    for _ in range(300):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))).encode()
        assert cfg.fullmatch(s) == reference.fullmatch(s), (text, regex, s)


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


@pytest.mark.parametrize("grammar, reference, alphabet", [
    (ARITHMETIC, python_arithmetic, "129+*/()-"), (BRACKETS, balanced, "()[]x")])
def test_recursive_grammars_accept_what_a_reference_recognizer_does(grammar, reference, alphabet):
    """On random strings and on every prefix of the ones accepted: accepted exactly when the reference accepts,
    every prefix of an accepted string a live state, and the state may end exactly where the prefix is accepted."""
    cfg, g, rng = Cfg(grammar), Grammar.ebnf(grammar), random.Random(grammar)
    accepted = 0
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
        assert cfg.fullmatch(s.encode()) == reference(s), s
        if reference(s):
            accepted += 1
            for cut in range(1, len(s) + 1):
                state = g.run(g.start, s[:cut].encode())
                assert state is not None and Grammar.may_end(state) == reference(s[:cut]), (s, cut)
    assert accepted > 50


@settings(max_examples=80, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) |
                    st.text(max_size=6), lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10),
       st.sampled_from([None, 1]), st.booleans())
def test_a_json_grammar_accepts_what_json_dumps_writes(value, indent, ascii_only):
    """A JSON grammar in GBNF (strings with escapes, numbers with exponents, nesting): every object ``json.dumps``
    writes is a sentence; cut short it is a live prefix that may not end."""
    text = json.dumps({"v": value}, indent=indent, ensure_ascii=ascii_only).encode()
    g = Grammar.ebnf(JSON_GBNF)
    assert Grammar.complete(g.run(g.start, text))
    assert not Grammar.may_end(g.run(g.start, text[:-1]))


@pytest.mark.parametrize("grammar, words", [
    ('root ::= root "a" | "b"', "left-recursive"),
    ('root ::= a\na ::= b "x"\nb ::= "y" | root', "left-recursive"),
    ('root ::= n root "x" | "y"\nn ::= "z"?', "left-recursive"),  # through a rule that may be empty
    ('root ::= x', "used but not defined"),
    ('start ::= "a"', "no rule 'root'"),
    ('root ::= "" | ("")*', "only the empty string"),
    ('root ::= a\na ::= a "x" "y" | "q" a', "matches nothing"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('root ::= [a-', "not closed"), ('root ::= "abc', "not closed"), ('root ::= ("a"', "unclosed"),
    ('root ::= "\\q"', "bad escape"), ('root ::= [z-a]', "bad range"), ('root ::= "a"{3,2}', "repetition"),
    ('root ::= "a"{2000}', "repetition"), ('root "a"', "'::='"), ('root ::= "a" | @', "unexpected"),
    ('root ::= (("a" "b"){1000}){30}', "too large"),
    (12, "a string"),
])
def test_grammars_that_cannot_be_enforced_are_refused(grammar, words):
    with pytest.raises(EbnfError, match=re.escape(words)):
        Cfg(grammar)


def test_dead_alternatives_are_pruned_so_every_state_can_finish():
    """A branch through a rule that derives nothing is never offered; a random walk over allowed bytes never
    reaches a state with no way on and no end."""
    g = Grammar.ebnf('root ::= "a" dead | "b" more\ndead ::= "q" dead\nmore ::= ("," [0-9])* "."?')
    assert g.step(g.start, ord("a")) is None and g.step(g.start, ord("b")) is not None
    rng = random.Random(3)
    for grammar in (ARITHMETIC, BRACKETS, JSON_GBNF):
        g = Grammar.ebnf(grammar)
        for _ in range(30):
            state = g.start
            for _ in range(40):
                nexts = [b for b in range(256) if g.step(state, b) is not None]
                assert nexts or Grammar.may_end(state)
                if not nexts:
                    break
                state = g.step(state, rng.choice(nexts))


def test_right_recursion_is_a_tail_call_and_nesting_grows_the_stack_only_as_written():
    cfg = Cfg('root ::= "x" root | "y"')
    frames = [cfg.start()]
    for _ in range(500):
        frames = [f for s in frames for f in cfg.step(s, ord("x"))]
    assert max(len(f) for f in frames) == 1 and cfg.fullmatch(b"x" * 500 + b"y")
    cfg = Cfg(BRACKETS)
    deep = [cfg.start()]
    for _ in range(50):
        deep = [f for s in deep for f in cfg.step(s, ord("("))]
    assert 50 <= max(len(f) for f in deep) <= 52


def test_a_grammar_inside_fixed_text_and_after_thinking():
    g = Grammar.ebnf(BRACKETS, prefix=b"<", suffix=b">", thinking="open")
    assert Grammar.complete(g.run(g.start, b"hmm</think>\n<([x])>"))
    assert g.run(g.start, b"</think><(x]>") is None


# --- masks and generations -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "(", "(x", "(x)", "(x)[", "x"])
def test_masks_allow_the_end_token_exactly_where_a_sentence_may_end(text):
    """Masks against a token-by-token check from the full state (every token read byte by byte)."""
    tokens = [bytes([b]) for b in range(256)] + [b"(x)", b"x)", b"[[", b"(]"]
    vocab = Vocabulary(tokens + [None], len(tokens) + 1, end_ids=[len(tokens)])
    g = Grammar.ebnf(BRACKETS)
    state = g.run(g.start, text.encode())
    mask = GrammarMasks(g, vocab, "cpu").mask(state)
    want = [g.run(state, t) is not None for t in tokens] + [Grammar.may_end(state) and not Grammar.complete(state)]
    assert mask.tolist() == want
    assert mask[len(tokens)] == balanced(text)


def test_tiny_model_outputs_are_sentences_of_their_grammar(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    stopped = 0
    for grammar in (ARITHMETIC, BRACKETS, 'root ::= ("yes" | "no") ("," [ ]? ("yes" | "no"))*'):
        cfg = Cfg(grammar)
        for seed in range(2):
            for o in llm.generate(["hello", "x y"], SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                                                                   grammar=grammar)):
                ids = o.token_ids[:-1] if o.token_ids[-1] == EOS_ID else o.token_ids
                assert EOS_ID not in ids
                if o.finish_reason == "stop":
                    stopped += 1
                    assert cfg.fullmatch(bytes(ids)), (grammar, bytes(ids))  # the tiny tokenizer: a token a byte
                else:
                    assert Grammar.ebnf(grammar).run(Grammar.ebnf(grammar).start, bytes(ids)) is not None
    assert stopped >= 4


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='root::= "ab\\|()[]^-*+?{},0123.#\nxu', max_size=30))
def test_any_text_compiles_or_is_refused_with_a_grammar_error(text):
    try:
        cfg = Cfg(text)
    except EbnfError:
        return
    assert cfg.moves(cfg.start())[0]  # something to read


@pytest.mark.parametrize("grammar, text", [
    (JSON_GBNF, json.dumps({"k": "a \"quoted\" wörd", "n": [1, -2.5e3, {"x": None}], "t": True}, indent=1)),
    ('root ::= "say: " [^\\n]* "\\n" ("more" [a-z ]*)?', "say: hello there, é!\nmore words"),
    ('root ::= "x" [a-z] [a-z] [0-9]+ [^0-9]*', "xqr12 fin"),  # many bytes lead on, but not round a loop
])
def test_masks_of_broad_states_equal_a_token_by_token_check(grammar, text):
    """States that many bytes lead into a loop (a string's text, a free line) get masks without walking the tokens
    made of those bytes; every mask along the text equals reading each token from the state."""
    rng = random.Random(7)
    alphabet = [bytes([b]) for b in b'ab "\\{}[]:,.\n-0123456789etrunlsfx'] + ["é".encode(), "ö".encode()]
    tokens = [bytes([b]) for b in range(256)] + sorted({b"".join(rng.choice(alphabet) for _ in range(rng.randint(
        2, 6))) for _ in range(3000)})
    vocab = Vocabulary(tokens, len(tokens))
    g = Grammar.ebnf(grammar)
    masks, state, looped = GrammarMasks(g, vocab, "cpu"), g.start, 0
    for b in text.encode():
        want = [g.run(state, t) is not None for t in tokens]
        looped += masks._pattern_of(state) == -1 and masks._broad(state, -1) and \
            masks._looped(state, 10 ** 9) is not None
        assert masks.mask(state).tolist() == want, (text, state)
        state = g.step(state, b)
    assert looped >= 2  # the shortcut was taken


def test_an_ambiguous_grammar_keeps_a_bounded_number_of_parses_and_still_finishes():
    """Two ways to read every "(" double the parses with each one: past the bound only the shallowest are kept;
    what is left still reads the text and closes it."""
    g = Grammar.ebnf('root ::= ("(" root ")" | "(" root? ")" | "x")+')
    state = g.run(g.start, b"(" * 40)
    assert len(state) <= 256 + 1
    assert Grammar.may_end(g.run(state, b"x" + b")" * 40)) and g.run(state, b")" * 41) is None
