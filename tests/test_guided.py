"""Structured output: the grammar's byte automaton against Python's JSON parser and jsonschema, schema compile
errors, the cached vocabulary masks against a token-by-token check from the full state, the sampler honouring
masks, and whole generations (tiny random model, the real SmolLM2) that end as valid JSON."""
import json
import random
import re

import jsonschema
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from typing import Literal, Optional

from dualpath import LLM, SamplingParams
from dualpath import grammar as gr
from dualpath.errors import CheckpointError
from dualpath.grammar import MAX_WS, Grammar, SchemaError
from dualpath.tokenizer import Tokenizer
from engines.guided import GrammarMasks, GuideError, Recent, Vocabulary
from engines.sampler import sample

JSON_MODE = Grammar.json_object()
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
    max_leaves=12)
OBJECTS = st.dictionaries(st.text(max_size=5), JSON, max_size=5)
STYLES = st.sampled_from([dict(), dict(indent=2), dict(indent=4, ensure_ascii=False), dict(separators=(",", ":")),
                          dict(indent="\t", ensure_ascii=False)])


def _no_constants(name):
    raise ValueError(name)


def parsed(data: bytes):
    """The oracle's parse: strict JSON (no NaN/Infinity, no raw control characters), or None."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except ValueError:
        return None


def parses_as_object(data: bytes) -> bool:
    return isinstance(parsed(data), dict)


def run(g: Grammar, data: bytes):
    return g.run(g.start, data)


def completes(g: Grammar, data: bytes) -> bool:
    state = run(g, data)
    return state is not None and g.complete(state)


def completion(state) -> bytes:
    """A suffix that closes whatever is open in a JSON-mode state (test-side: read off the mode, not stepped)."""
    (mode, node, stack, _), = state
    if mode == gr.LIT:
        head = min(node)
    elif mode >= gr.UTF8_STR:
        base = gr.UTF8_KEY if mode >= gr.UTF8_KEY else gr.UTF8_STR
        due, first = divmod(mode - base, 10)
        head = bytes([gr.NEXT_RANGE[first][0]]) + b"\x80" * (due - 1) + (b'":0' if base == gr.UTF8_KEY else b'"')
    elif mode >= gr.U_KEY:
        head = b"0" * (mode - gr.U_KEY) + b'":0'
    elif mode >= gr.U_STR:
        head = b"0" * (mode - gr.U_STR) + b'"'
    else:
        head = {gr.VALUE: b"0", gr.VALUE_OR_CLOSE: b"", gr.KEY_OR_CLOSE: b"", gr.KEY: b'"k":0', gr.COLON: b":0",
                gr.AFTER: b"", gr.DONE: b"", gr.STR: b'"', gr.STR_ESC: b'n"', gr.KEY_STR: b'":0',
                gr.KEY_ESC: b'n":0', gr.NUM_MINUS: b"1", gr.NUM_ZERO: b"", gr.NUM_INT: b"", gr.NUM_DOT: b"5",
                gr.NUM_FRAC: b"", gr.NUM_E: b"1", gr.NUM_SIGN: b"1", gr.NUM_EXP: b""}[mode]
    if mode == gr.VALUE and not stack:
        head = b"{"
        stack = (("o",),)
    return head + b"".join(b"}" if f[0] == "o" else b"]" for f in reversed(stack))


def ws_runs_ok(data: bytes) -> bool:
    run_len = 0
    for b in data:
        run_len = run_len + 1 if b in b" \t\n\r" else 0
        if run_len > MAX_WS:
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(OBJECTS, STYLES)
def test_every_serialized_object_is_accepted_and_completes_exactly_at_its_end(obj, style):
    data = json.dumps(obj, **style).encode()
    state = JSON_MODE.start
    for i, b in enumerate(data):
        assert not JSON_MODE.complete(state), f"complete before byte {i} of {data!r}"
        state = JSON_MODE.step(state, b)
        assert state is not None, f"rejected byte {i} of {data!r}"
    assert JSON_MODE.complete(state)


def mutated(data: bytes, rng: random.Random, alphabet: bytes = b'{}[]":,-+.0123456789eEtrufalsn \n\\ux\x01') -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        i, op = rng.randrange(len(out) + 1), rng.randrange(3)
        c = alphabet[rng.randrange(len(alphabet))]
        if op == 0:
            out.insert(i, c)
        elif out and i < len(out):
            if op == 1:
                del out[i]
            else:
                out[i] = c
    return bytes(out)


@settings(max_examples=200, deadline=None)
@given(OBJECTS, STYLES, st.integers(0, 2**32))
def test_json_mode_agrees_with_the_json_parser_on_mutated_documents(obj, style, seed):
    """Soundness and completeness: a mutated document completes iff it parses as an object (within the whitespace
    cap, nothing after the object), and every prefix the automaton accepts closes into one that does."""
    data = mutated(json.dumps(obj, **style).encode(), random.Random(seed))
    state, accepted = JSON_MODE.start, 0
    for b in data:
        nxt = JSON_MODE.step(state, b)
        if nxt is None:
            break
        state, accepted = nxt, accepted + 1
    whole = accepted == len(data) and JSON_MODE.complete(state)
    expect = parses_as_object(data) and ws_runs_ok(data) and data == data.rstrip()
    assert whole == expect, data
    closed = data[:accepted] + completion(state)
    assert parses_as_object(closed), (data[:accepted], closed)


def test_limits():
    assert completes(JSON_MODE, b"{" + b" " * MAX_WS + b"}")
    assert run(JSON_MODE, b"{" + b" " * (MAX_WS + 1)) is None
    for bad in (b'{"a": 01}', b'{"a": 1.}', b'{"a": NaN}', b"[1]", b'{"a": "\x0a"}', b"{} ", b'"a"'):
        assert run(JSON_MODE, bad) is None, bad


# --- schemas -----------------------------------------------------------------------------------------------------

class Address(BaseModel):
    street: str
    city: str
    zip: Optional[str] = None


class Person(BaseModel):
    name: str = Field(description="full name")
    age: int
    height: float
    tags: list[Literal["admin", "user", "guest"]]
    address: Address
    friends: list["Person"] = []
    active: bool
    note: Optional[str] = None


class Account(BaseModel):
    handle: str = Field(pattern=r"^[a-z][a-z0-9_]{2,11}$")
    display: str = Field(min_length=1, max_length=12)
    email: str = Field(pattern=r"^[a-z0-9.]+@[a-z]+\.(com|org)$")
    code: Optional[str] = Field(None, pattern=r"^[A-F0-9]{4}$")
    note: str = Field("", max_length=3)


SCHEMAS = {
    "pydantic": Person.model_json_schema(),
    "strings": {**Account.model_json_schema(), "properties": {
        **Account.model_json_schema()["properties"],
        "quoted": {"type": "string", "pattern": "[\"\\\\ \n\u00e9a-c]{1,3}", "minLength": 2},
        "word": {"enum": ["ab", "abcd", 7], "maxLength": 3}, "long": {"type": "string", "minLength": 3},
        "free": {"type": "string", "pattern": "[^x]{0,6}"}}},  # reads quotes, backslashes, controls like text
    "closed": {"type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["a", "b", 3, None]},
                                                 "xs": {"type": "array", "items": {"type": ["number", "null"]}}},
               "required": ["id", "kind"], "additionalProperties": False},
    "bounded": {"type": "object", "additionalProperties": False, "required": ["xs", "tags"], "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2},
        "none": {"type": "array", "maxItems": 0}}},
    "open": {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n", "m"],
             "additionalProperties": {"type": "string"}},
    "choice": {"anyOf": [{"type": "object", "properties": {"t": {"const": "x"}, "v": {"type": "integer"}},
                          "required": ["t", "v"], "additionalProperties": False},
                         {"type": "object", "properties": {"t": {"const": "y"}, "v": {"type": "string"}},
                          "required": ["t", "v"], "additionalProperties": False}]},
}


def instances(schema, root=None, depth=0):
    """Hypothesis values valid against ``schema`` (the subset the grammar takes; test-side generator)."""
    root = root if root is not None else schema
    if schema is True or schema == {}:
        return JSON
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return instances(target, root, depth + 1)
    if "anyOf" in schema:
        return st.one_of([instances(s, root, depth + 1) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return st.sampled_from([v for v in values if jsonschema.Draft202012Validator(schema).is_valid(v)])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([instances({**schema, "type": x}, root, depth) for x in t])
    if t == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties", True)
        req = {k: instances(props[k], root, depth + 1) if k in props else instances(extra, root, depth + 1)
               for k in required}
        opt = {k: instances(v, root, depth + 1) for k, v in props.items() if k not in required and depth < 3}
        base = st.fixed_dictionaries(req, optional=opt)
        if extra is False or depth >= 3:
            return base
        more = st.dictionaries(st.text(max_size=4).filter(lambda k: k not in props and k not in required),
                               instances(extra, root, depth + 1), max_size=2)
        return st.tuples(base, more).map(lambda p: {**p[1], **p[0]})
    if t == "array":
        least, most = schema.get("minItems", 0), schema.get("maxItems", 3 if depth < 3 else 0)
        return st.lists(instances(schema.get("items", True), root, depth + 1), min_size=least,
                        max_size=max(least, most))
    if t == "string" and ({"pattern", "minLength", "maxLength"} & set(schema)):
        return ruled_strings(schema)
    return {"string": st.text(max_size=6), "integer": st.integers(-10**9, 10**9), "boolean": st.booleans(),
            "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers(), "null": st.none()}[t]


def ruled_strings(schema):
    """Strings satisfying a string schema's pattern (as a whole) and length bounds, written escaped or raw."""
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    text = st.from_regex(schema["pattern"], fullmatch=True) if "pattern" in schema else \
        st.text(min_size=least, max_size=most if most is not None else least + 6)
    bmp = text.filter(lambda t: all(ord(c) <= 0xFFFF for c in t))  # in a ruled string, escapes stay in the BMP
    return bmp.filter(lambda t: least <= len(t) <= (most if most is not None else len(t)) and (
        "pattern" not in schema or re.fullmatch(schema["pattern"], t, re.ASCII)))


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_instances_are_accepted_and_mutations_that_complete_are_valid(name):
    schema = SCHEMAS[name]
    g = Grammar.compile(schema)
    validator = jsonschema.Draft202012Validator(schema)

    @settings(max_examples=75, deadline=None)
    @given(instances(schema), STYLES, st.integers(0, 2**32))
    def check(value, style, seed):
        data = json.dumps(value, **style).encode()
        assert completes(g, data), data
        bad = mutated(data, random.Random(seed), b'{}[]":,-.0123456789etrufalsn \nabxyz')
        if completes(g, bad):
            assert validator.is_valid(parsed(bad)), bad

    check()


@pytest.mark.parametrize("schema, words", [
    ({"type": "string"}, "top level must be an object"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)x"}}}, "pattern: look-ahead"),
    ({"type": "object", "properties": {"a": {"pattern": 3}}}, "pattern must be a string"),
    ({"type": "object", "properties": {"a": {"pattern": r"\d{5}", "maxLength": 4}}}, "no string satisfies"),
    ({"type": "object", "properties": {"a": {"minLength": 2, "maxLength": 1}}}, "minLength <= maxLength"),
    ({"type": "object", "properties": {"a": {"pattern": r"(\d?){999}", "maxLength": 999}}}, "too large"),
    ({"type": "object", "properties": {"a": {"enum": ["abc"], "maxLength": 2}}}, "no value satisfies"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "minimum cannot be enforced"),
    ({"oneOf": [{"type": "object"}]}, "oneOf cannot be enforced"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "no value satisfies"),
    ({"type": "object", "properties": {"a": {"type": "string", "enum": [1]}}}, "no value satisfies"),
    ({"type": "object", "required": ["b"], "additionalProperties": False}, "not in properties"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}}, "points nowhere"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "only local"),
    ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}, "cycle"),
    ({"type": "object", "properties": {"a": {"type": "date"}}}, "type must be"),
    ({"allOf": [{"type": "object"}, {"type": "object"}]}, "allOf of more than one"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}, "minItems <= maxItems"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": -1}}}, "must be counts"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "uniqueItems cannot be"),
])
def test_schemas_that_cannot_be_enforced_are_refused(schema, words):
    with pytest.raises(SchemaError, match=words):
        Grammar.compile(schema)


KEYWORDS = st.sampled_from(["type", "properties", "required", "additionalProperties", "items", "enum", "const",
                             "anyOf", "allOf", "$ref", "$defs", "title", "minLength", "oneOf"])
SCHEMA_LIKE = st.recursive(
    JSON | st.sampled_from(["object", "array", "string", "#", "#/$defs/a", "#/properties/a"]),
    lambda kids: st.dictionaries(KEYWORDS | st.sampled_from(["a", "b"]), kids, max_size=4) | st.lists(kids, max_size=3),
    max_leaves=10)


@settings(max_examples=250, deadline=None)
@given(SCHEMA_LIKE)
@example({"type": [[]], "enum": [None]})  # found by this test: an unhashable type name was a TypeError (a 500)
@example({"type": [{}], "properties": {}})
def test_any_schema_compiles_or_is_refused_with_a_schema_error(schema):
    try:
        g = Grammar.compile(schema)
    except SchemaError:
        return
    assert g.run(g.start, b"{") is not None  # a compiled grammar starts an object


def test_schema_rules():
    g = Grammar.compile(SCHEMAS["closed"])
    assert completes(g, b'{"kind": null, "id": 3}') and completes(g, b'{"id": -0, "kind": "b", "xs": [1.5, null]}')
    for bad in (b'{"id": 3}', b'{"id": 3.0, "kind": 3}', b'{"id": 1, "kind": "c"}', b'{"id": 1, "kind": 3, "z": 1}',
                b'{"id": 1, "id": 2, "kind": 3}', b'{"id": 1, "kind": "\\u0061"}'):
        assert not completes(g, bad), bad
    open_ = Grammar.compile(SCHEMAS["open"])
    assert completes(open_, b'{"m": "x", "n": 1e5, "zz": "y"}') and not completes(open_, b'{"n": 1}')
    assert not completes(open_, b'{"n": 1, "m": 2}') and not completes(open_, b'{"m": "x", "n": 1, "\\u006e": 2}')
    bounded = Grammar.compile(SCHEMAS["bounded"])
    assert completes(bounded, b'{"xs": [1], "tags": ["a", "a"]}')
    assert completes(bounded, b'{"tags":["b","a","b"],"xs":[1,2,3],"none":[]}')
    for bad in (b'{"xs": [], "tags": ["a", "a"]}', b'{"xs": [1, 2, 3, 4], "tags": ["a", "b"]}',
                b'{"xs": [1], "tags": ["a"]}', b'{"xs": [1], "tags": ["a", "b"], "none": [1]}'):
        assert not completes(bounded, bad), bad
    # past minItems an unbounded array counts no further: its states (and masks) are shared
    assert run(bounded, b'{"tags": ["a", "b", "a"') == run(bounded, b'{"tags": ["a", "b", "a", "b", "a"')
    choice = Grammar.compile(SCHEMAS["choice"])
    assert completes(choice, b'{"v": 3, "t": "x"}') and completes(choice, b'{"t": "y", "v": "3"}')
    assert not completes(choice, b'{"t": "x", "v": "3"}')
    state = run(choice, b'{"v": ')
    assert len(state) == 2  # both branches alive until the value says which


# --- masks over a vocabulary ---------------------------------------------------------------------------------

def toy_vocab() -> list:
    """Every byte, multi-byte tokens with several closers, escapes and literals, and special tokens (None)."""
    multi = [b"}}", b"]}", b"}]", b'"}', b'"]}', b'}}}', b'": "', b'", "', b'":', b"\\n", b'\\"', b"\\u00",
             b"true", b"false", b"null", b"truefalse", b"0.5e", b"-1", b"12", b"{\"", b"[[", b"[]", b"{}", b"  ",
             b"\n  ", b"\n    ", b"}\n", b"1}", b'"a"', b"e+", b"\xc3\xa9", b"\xc3", b", ", b":[", b"],", b"},{",
             b'"name', b'"street": "', b'admin"', b'"tags": ["', b"ity", b"age", b"abcd", b"\xc3\xa9t\xc3\xa9", b"ab_9",
             b"@a.com", b"\\u00e9", b'\\"', b"AB12"]
    return [bytes([b]) for b in range(256)] + multi + [None, None]


def states_along(g: Grammar, data: bytes):
    state = g.start
    for b in data:
        yield state
        state = g.step(state, b)
        assert state is not None


def brute_mask(g: Grammar, vocab: list, state, width: int) -> torch.Tensor:
    return torch.tensor([t is not None and g.run(state, t) is not None for t in vocab] + [False] * (width - len(vocab)))


@pytest.mark.parametrize("name", ["json", "pydantic", "choice", "bounded", "strings"])
def test_cached_masks_equal_a_check_of_every_token_from_the_full_state(name):
    vocab = toy_vocab()
    v = Vocabulary(vocab, len(vocab) + 3)
    assert v.depth == 4  # '}}}' closes three: the mask keys keep four levels
    if name == "json":
        g = JSON_MODE
        deep = {"a": [[[[{"b": [{"c": {"d": [1, -2.5e-3, "x\\u00e9\n", True, None]}}]}]]]], "e": {}, "f": []}
        docs = [json.dumps(deep).encode(), json.dumps(deep, indent=2).encode(), b'{"k": [[[[[]]]]], "z": 0}']
    elif name == "pydantic":
        g = Grammar.compile(SCHEMAS["pydantic"])
        kid = {"name": "b", "age": 2, "height": 1.5, "tags": [], "address": {"street": "s", "city": "c"},
               "active": False}
        person = {"name": "a\u00e9", "age": 3, "height": 1e2, "tags": ["admin", "guest"], "active": True,
                  "address": {"street": "s", "city": "c", "zip": None},
                  "friends": [{**kid, "friends": [{**kid, "friends": [kid]}]}], "note": "n"}
        docs = [json.dumps(person).encode(), json.dumps(person, indent=1).encode()]
    elif name == "strings":
        g = Grammar.compile(SCHEMAS["strings"])
        docs = [b'{"handle": "ab_9", "display": "\xc3\xa9t\xc3\xa9 \\u00e9\\n", "email": "a.b@ab.org", "code": "AB12", '
                b'"quoted": "\\"\\\\", "word": "ab", "long": "abcd\\"\\u00e9", "free": "ab\\"\\u00e9t\\n"}',
                b'{"email":"x@y.com","note":"abc","code":null,"quoted":"\\u00e9a","display":"abcdabcdabcd",'
                b'"handle":"z99"}']
    elif name == "choice":
        g = Grammar.compile(SCHEMAS["choice"])
        docs = [b'{"v": 3, "t": "x"}', b'{ "v" : "3" , "t" : "y" }']
    else:
        g = Grammar.compile(SCHEMAS["bounded"])
        docs = [b'{"xs": [1, 22, 333], "tags": ["a", "b", "a", "a"], "none": []}', b'{"tags":["b","b"],"xs":[7]}']
    masks = GrammarMasks(g, v, "cpu")
    seen = 0
    for doc in docs:
        for state in states_along(g, doc):
            assert torch.equal(masks.mask(state), brute_mask(g, vocab, state, v.width)), state
            seen += 1
    assert seen > 30 and len(masks.cache) < seen  # states share masks


def test_grammars_share_one_bounded_mask_cache_without_mixing_their_masks():
    vocab = toy_vocab()
    v, cache = Vocabulary(vocab, len(vocab)), Recent(size=3)
    free, closed = JSON_MODE, Grammar.compile(SCHEMAS["closed"])
    a, b = GrammarMasks(free, v, "cpu", cache, "free"), GrammarMasks(closed, v, "cpu", cache, "closed")
    after_brace = free.run(free.start, b"{")
    assert not torch.equal(a.mask(after_brace), b.mask(closed.run(closed.start, b"{")))  # same modes, other masks
    for doc in (b'{"id": 1, "kind": "a"}', b'{"kind": null, "id": 2}'):
        for state in states_along(closed, doc):
            assert torch.equal(b.mask(state), brute_mask(closed, vocab, state, v.width))
            assert len(cache) <= 3
    assert torch.equal(a.mask(after_brace), brute_mask(free, vocab, after_brace, v.width))  # rebuilt after eviction


def test_a_guide_follows_its_tokens_and_refuses_others():
    vocab = toy_vocab()
    masks = GrammarMasks(JSON_MODE, Vocabulary(vocab, len(vocab)), "cpu")
    g = masks.guide()
    ids = {t: i for i, t in enumerate(vocab) if t is not None}
    for tok in [b"{\"", b"a", b'": "', b"x", b'"', b",", b" ", b'"a"', b":[", b"true", b"]}"]:
        assert g.mask()[ids[tok]]
        g.advance(ids[tok])
    assert g.complete
    g2 = masks.guide()
    with pytest.raises(GuideError):
        g2.advance(ids[b"["])
    with pytest.raises(GuideError):
        g2.advance(len(vocab) - 1)  # a special token


def test_random_walks_over_masks_end_valid():
    """What sampling under masks does, with a model that picks at random among allowed tokens (leaning to ones
    that close things): every walk that completes is valid against its schema."""
    vocab = toy_vocab()
    v = Vocabulary(vocab, len(vocab))
    closing = torch.tensor([t is not None and any(c in t for c in b'"}]') for t in vocab])
    ended = 0
    for name in ("json", "pydantic", "closed", "open", "choice", "bounded", "strings"):
        g = JSON_MODE if name == "json" else Grammar.compile(SCHEMAS[name])
        validator = jsonschema.Draft202012Validator({"type": "object"} if name == "json" else SCHEMAS[name])
        masks = GrammarMasks(g, v, "cpu")
        rng = torch.Generator().manual_seed(0)
        for _ in range(8):
            guide, out = masks.guide(), b""
            for _ in range(400):
                m = guide.mask()
                pool = m & closing if (m & closing).any() and torch.rand(1, generator=rng) < 0.6 else m
                tok = int(pool.nonzero()[torch.randint(int(pool.sum()), (1,), generator=rng)])
                guide.advance(tok)
                out += vocab[tok]
                if guide.complete:
                    assert validator.is_valid(parsed(out)), out
                    ended += 1
                    break
    assert ended >= 25  # 32 of the 56 walks (seeded)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([None, r"[a-c]+", r"\d{2,4}", r"(ab|\n\")*x?", r"[^\x00-\x60]{1,3}", "é|[\\\\/]{2}"]),
       st.integers(0, 4), st.one_of(st.none(), st.integers(0, 6)), st.randoms(use_true_random=False))
def test_ruled_strings_never_reach_a_dead_end(pattern, least, most, rng):
    """Random bytes among those a state allows, inside a string with a pattern and/or length bounds (escapes,
    \\u escapes and raw UTF-8 included): every state reached allows some byte, and what completes is valid."""
    rule = {k: v for k, v in (("pattern", pattern), ("minLength", least), ("maxLength", most)) if v is not None}
    schema = {"type": "object", "properties": {"s": {"type": "string", **rule}}, "required": ["s"],
              "additionalProperties": False}
    try:
        g = Grammar.compile(schema)
    except SchemaError:
        assume(most is not None and most < least or pattern is not None)  # unsatisfiable pairs only
        return
    state, out = g.run(g.start, b'{"s": "'), b'{"s": "'
    for _ in range(60):
        nxt = [b for b in range(256) if g.step(state, b) is not None]
        assert nxt, (schema, out)  # never a dead end
        b = rng.choice([x for x in nxt if x in b'"}'] or nxt) if rng.random() < 0.3 else rng.choice(nxt)
        state, out = g.step(state, b), out + bytes([b])
        if gr.Grammar.complete(state):
            assert jsonschema.Draft202012Validator(schema).is_valid(parsed(out)), out
            break


# --- thinking first: a reasoning model's think block, then the output --------------------------------------------

FORCED = (b"<tool_call>\n", b"\n</tool_call>")  # a forced call's markup around its object
THINK_TOKENS = [b"<think>", b"</think>", b"</", b"think>", b"k>", b">", b"</think>\n\n", b'k>{"', b"k>\n<tool_call>",
                b"</think>{}", b"\n<think>\n", b"x>", b"<<"]


@pytest.mark.parametrize("thinking, text, ok", [
    ("open", b'so {x</thi </think>\n\n{"a": 1}', True),
    ("open", b'</think>{"a": 1}', True),  # an empty thought
    ("open", b'<think>x<</think> {"a": 1}', True),  # anything, tags too, until </think>
    ("open", b'{"a": 1}', False),  # the block never closed: no output yet
    ("open", b"</think>" + b" " * (MAX_WS + 1) + b'{"a": 1}', False),
    ("optional", b'{"a": 1}', True),
    ("optional", b'\n <think>hm</think>\n{"a": 1}', True),
    ("optional", b'</think>{"a": 1}', False),  # a close without an open
    ("optional", b"x<think>", False),  # text before a block is output, and must be JSON
    ("optional", b'<think>a</think>{"a": 1}<think>', False),
    ("", b'<think>hm</think>{"a": 1}', False),
])
def test_thinking_before_the_object(thinking, text, ok):
    g = Grammar.json_object(thinking=thinking)
    assert completes(g, text) == ok
    forced = Grammar.json_object(*FORCED, thinking=thinking)
    marked = text.replace(b'{"a": 1}', FORCED[0] + b'{"a": 1}' + FORCED[1])
    assert completes(forced, marked) == ok and not completes(forced, text)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=40), OBJECTS, st.sampled_from(["open", "optional"]))
def test_any_thought_then_any_object_completes_only_at_its_end(thought, obj, thinking):
    head = b"" if thinking == "open" else b"<think>"
    thought = thought.replace(b"</think>", b"")
    text = head + thought + b"</think>\n" + json.dumps(obj).encode()
    g = Grammar.json_object(thinking=thinking)
    states = list(states_along(g, text))
    assert not any(g.complete(s) for s in states) and completes(g, text)


@pytest.mark.parametrize("thinking", ["open", "optional"])
def test_thinking_masks_equal_a_check_of_every_token(thinking):
    vocab = toy_vocab() + THINK_TOKENS
    v = Vocabulary(vocab, len(vocab) + 2)
    for prefix, suffix in ((b"", b""), FORCED):
        g = Grammar.compile(SCHEMAS["closed"], prefix, suffix, thinking)
        masks = GrammarMasks(g, v, "cpu")
        head = b"" if thinking == "open" else b" <think>"
        doc = head + b"x </thi<</think>\n\n" + prefix + b'{"id": 1, "kind": "a"}' + suffix
        for state in states_along(g, doc):
            assert torch.equal(masks.mask(state), brute_mask(g, vocab, state, v.width)), state


def test_random_walks_think_then_end_valid():
    """Walks that close the thought when they happen to spell </think> (leaning to its next byte), then write the
    object: every one that completes is a thought and a valid object."""
    vocab = toy_vocab() + THINK_TOKENS
    ids = {t: i for i, t in enumerate(vocab) if t is not None}
    validator = jsonschema.Draft202012Validator(SCHEMAS["closed"])
    masks = GrammarMasks(Grammar.compile(SCHEMAS["closed"], thinking="open"), Vocabulary(vocab, len(vocab)), "cpu")
    closing = torch.tensor([t is not None and any(c in t for c in b'"}]') for t in vocab])
    rng, ended = torch.Generator().manual_seed(0), 0
    for _ in range(20):
        guide, out = masks.guide(), b""
        for _ in range(400):
            m = guide.mask()
            (mode, matched, _, _), = guide.state if len(guide.state) == 1 else ((None, 0, 0, 0),)
            if mode == gr.THINKING and torch.rand(1, generator=rng) < 0.5:
                tok = ids[b"</think>"[matched:matched + 1]]
            else:
                pool = m & closing if (m & closing).any() and torch.rand(1, generator=rng) < 0.6 else m
                tok = int(pool.nonzero()[torch.randint(int(pool.sum()), (1,), generator=rng)])
            assert m[tok]
            guide.advance(tok)
            out += vocab[tok]
            if guide.complete:
                thought, _, answer = out.partition(b"</think>")
                assert validator.is_valid(parsed(answer)), out
                ended += 1
                break
    assert ended >= 10


def test_a_vocabulary_without_single_byte_tokens_is_refused():
    with pytest.raises(CheckpointError, match="one-byte token"):
        Vocabulary([b"{", b"}", b'"ab"'], 3)


# --- the sampler ---------------------------------------------------------------------------------------------

def test_sampling_takes_only_allowed_tokens_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    b, v = 6, 50
    logits = torch.randn(b, v) * 4
    masks = [torch.rand(v) < 0.2 if i % 2 == 0 else None for i in range(b)]
    for m in masks:
        if m is not None:
            m[-1] = True
    params = [SamplingParams(temperature=t, seed=i, logprobs=2) for i, t in enumerate([0, 0, 1.0, 1.0, 0.7, 0.7])]
    plain, plain_lp = sample(logits, params, [_gen(p) for p in params])
    for _ in range(5):
        toks, lps = sample(logits, params, [_gen(p) for p in params], masks)
        for i, (t, m) in enumerate(zip(toks, masks)):
            if m is None:
                assert t == plain[i] and lps[i] == plain_lp[i]  # rows without a mask: as if no row had one
            else:
                assert m[t]
                # logprobs stay the model's own (before the mask)
                assert abs(lps[i].logprob - logits[i].log_softmax(-1)[t].item()) < 1e-5
    greedy, _ = sample(logits[:1], params[:1], [None], masks[:1])
    allowed = logits[0].masked_fill(~masks[0], float("-inf"))
    assert greedy[0] == int(allowed.argmax())


def _gen(p: SamplingParams):
    from engines.sampler import make_generator
    return make_generator(p)


# --- whole generations -----------------------------------------------------------------------------------------

def test_tiny_model_json_mode_outputs_valid_json_object_prefixes(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    prompts = ["hello", "give me json", "a b c d e f"]
    for params in (SamplingParams(temperature=0, max_tokens=300, json_object=True),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=300, json_object=True)):
        outs = llm.generate(prompts, params)
        for o in outs:
            data = bytes(o.token_ids)  # the tiny tokenizer: one token per byte
            state = run(JSON_MODE, data)
            assert state is not None, data
            if o.finish_reason == "stop":
                assert parses_as_object(data), data
            else:
                assert o.finish_reason == "length" and len(o.token_ids) == 300
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    assert any(run(JSON_MODE, bytes(o.token_ids)) is None for o in free)  # unconstrained, it is not JSON


def test_tiny_model_schema_outputs_are_valid(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    validator = jsonschema.Draft202012Validator(SCHEMAS["closed"])
    stopped = 0
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, json_schema=json.dumps(SCHEMAS["closed"]))
        for o in llm.generate(["a", "bb", "ccc"], params):
            data = bytes(o.token_ids)
            assert run(Grammar.compile(SCHEMAS["closed"]), data) is not None
            if o.finish_reason == "stop":
                stopped += 1
                assert validator.is_valid(parsed(data)), data
    assert stopped >= 3


def test_tiny_model_strings_follow_their_patterns_and_lengths(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": r"^[A-F0-9]{4}-\d{2}$"},
                                               "tag": {"type": "string", "minLength": 2, "maxLength": 5}},
              "required": ["id", "tag"], "additionalProperties": False}
    validator = jsonschema.Draft202012Validator(schema)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300, json_schema=json.dumps(schema))
              for seed in range(3)]
    outs = [o for p in params for o in llm.generate(["a", "bb"], p)]
    assert sum(o.finish_reason == "stop" for o in outs) >= 3  # a random model writes much whitespace
    for o in outs:
        assert o.finish_reason == "length" or validator.is_valid(parsed(bytes(o.token_ids))), o.text


def test_tiny_model_thinks_freely_then_writes_json(tiny_dirs):
    """A thought is not constrained: until it writes </think>, a reply that thinks first is the model's own
    (greedy: what it writes unconstrained, among tokens that have text); the JSON comes after."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    prompts = ["hello", "a b c d e f", "think first"]
    texts = [i for i, t in enumerate(Tokenizer(tiny_dirs["llama"]).token_bytes) if t]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, allowed_token_ids=texts))
    thought = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, json_object=True,
                                                   json_thinking="open"))
    for f, o in zip(free, thought):
        assert b"</think>" not in bytes(f.token_ids) and o.token_ids == f.token_ids
    json_first = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, json_object=True))
    assert all(run(JSON_MODE, bytes(o.token_ids)) is not None for o in json_first)
    assert [o.token_ids for o in json_first] != [o.token_ids for o in thought]
    optional = Grammar.json_object(thinking="optional")
    for o in llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=40, json_object=True,
                                                  json_thinking="optional")):
        assert run(optional, bytes(o.token_ids)) is not None


@pytest.mark.parametrize("markup", ["hermes", "llama3", "deepseek_v3"])
def test_forced_tool_calls_from_a_model_parse_as_one_valid_call(tiny_dirs, markup):
    """tool_choice "required" as the engines run it: the markup's text around a call object; every reply that
    stops is one call to one of the tools, its arguments valid against that tool's parameters."""
    from dualpath.serving.tools import DeepSeekV3, Hermes, Llama3Json, ToolCallSplitter

    # no free strings: a random model rarely closes one within the token budget
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"days": {"type": "integer"}},
                                                         "required": ["days"], "additionalProperties": False}},
                 {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                                      "required": ["zone"], "additionalProperties": False}}]
    m = {"hermes": Hermes(), "llama3": Llama3Json(), "deepseek_v3": DeepSeekV3()}[markup]
    shape = m.forced(functions)  # DeepSeek's names the function before the arguments: a branch per function
    assert (shape.prefix, shape.suffix) == {"hermes": ("<tool_call>\n", "\n</tool_call>"), "llama3": ("", "")}.get(
        markup, (shape.prefix, shape.suffix))
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    calls = 0
    for seed in range(2):  # every one of these 4 replies ends in a call (seeded; 8 of 8 with 4 seeds too)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=400, **shape.sampling())
        for o in llm.generate(["x", "yy"], params):
            if o.finish_reason != "stop":
                continue
            splitter = ToolCallSplitter(m, frozenset(f["name"] for f in functions))
            assert splitter.feed(o.text) + splitter.finish() == "", o.text
            (call,) = splitter.calls
            fn = next(f for f in functions if f["name"] == call["function"]["name"])
            assert jsonschema.Draft202012Validator(fn["parameters"]).is_valid(json.loads(call["function"]["arguments"]))
            calls += 1
    assert calls >= 3


@pytest.mark.slow  # ~14 s of the real model's decoding; JSON mode through engines and clusters runs by default
def test_smollm2_answers_in_json(smollm2_dir):
    llm = LLM(str(smollm2_dir))
    chats = [[{"role": "system", "content": "Reply in JSON."},
              {"role": "user", "content": "Give a person with name and age as JSON."}],
             [{"role": "user", "content": "List three colors."}]]
    for o in llm.chat(chats, SamplingParams(temperature=0, max_tokens=120, json_object=True)):
        assert o.finish_reason == "stop", o.text
        assert isinstance(json.loads(o.text), dict), o.text
    free = llm.chat(chats[1:], SamplingParams(temperature=0, max_tokens=40))[0].text
    assert not parses_as_object(free.encode())
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"enum": ["Paris", "London", "Rome"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    o = llm.chat(chats[0], SamplingParams(temperature=0, max_tokens=120, json_schema=json.dumps(schema)))[0]
    assert o.finish_reason == "stop" and jsonschema.Draft202012Validator(schema).is_valid(json.loads(o.text)), o.text


# --- token bytes -------------------------------------------------------------------------------------------------

def _write(tok, path):
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def test_token_bytes_of_byte_level_and_sentencepiece_tokenizers(tiny_dirs, tmp_path):
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HF

    byte_level = Tokenizer(tiny_dirs["llama"])
    tb = byte_level.token_bytes
    assert all(tb[i] == bytes([i]) for i in range(256))  # the tiny tokenizer: token i is byte i
    assert tb[byte_level.eos_token_id] is None  # special tokens add no text
    text = 'héllo {"a": [1]}'
    assert b"".join(tb[i] for i in byte_level.encode(text)) == text.encode()

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"\u2581hi": 256, "\u2581": 257, "lo": 258, "<s>": 259}
    sp = HF(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens([AddedToken("<s>", special=True)])
    sp_bytes = _write(sp, tmp_path / "sp").token_bytes
    assert sp_bytes[0x41] == b"A" and sp_bytes[0xC3] == b"\xc3" and sp_bytes[256] == b" hi"
    assert sp_bytes[258] == b"lo" and sp_bytes[259] is None

    wp = HF(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.decoder = decoders.WordPiece()
    with pytest.raises(CheckpointError, match="byte-level"):
        _write(wp, tmp_path / "wp").token_bytes


def test_an_engine_indexes_the_vocabulary_off_its_loop(tiny_dirs):
    """The first structured request: ``guides_ready`` returns at once and the ~0.4 s vocabulary pass runs on a
    helper thread, which then hands the work back; later requests (and unconstrained ones) go straight through. A
    pass that fails still hands the work back, and the request then fails with the reason."""
    import threading
    import time
    from types import SimpleNamespace

    from engines.engine import Engine
    from engines.guided import GuideSource

    tok = Tokenizer(tiny_dirs["llama"])

    def slow():
        time.sleep(0.5)
        return tok
    engine = SimpleNamespace(guides=GuideSource(slow, 320, "cpu"))
    json_mode, free = SamplingParams(json_object=True), SamplingParams()
    back = threading.Event()
    t0 = time.perf_counter()
    assert not Engine.guides_ready(engine, json_mode, back.set)
    assert time.perf_counter() - t0 < 0.2 and Engine.guides_ready(engine, free, None)
    assert back.wait(10) and Engine.guides_ready(engine, json_mode, None)
    assert engine.guides.guide_for(json_mode) is not None

    def broken():
        raise CheckpointError("no token bytes")
    engine = SimpleNamespace(guides=GuideSource(broken, 320, "cpu"))
    back.clear()
    assert not Engine.guides_ready(engine, json_mode, back.set) and back.wait(10)
    assert Engine.guides_ready(engine, json_mode, None)  # the work goes on, to fail (no pass retried in a loop)
    with pytest.raises(CheckpointError, match="no token bytes"):
        engine.guides.guide_for(json_mode)
