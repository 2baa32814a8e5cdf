"""Structured output: JSON mode and schemas (llguidance, through ``dualpath.core.structured``) against Python's JSON parser
and jsonschema, schemas it refuses, the engines' masks over a vocabulary against a token-by-token check, the sampler
honouring masks, and whole generations (tiny random model, the real SmolLM2) that end as valid JSON."""

import json
import random
import re
import time

import jsonschema
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from typing import Literal, Optional

from dualpath import LLM, SamplingParams
from dualpath.core.errors import CheckpointError
from dualpath.core.structured import MAX_WS, GrammarError, check, compile
from dualpath.core.tokenizer import Tokenizer
from dualpath.engines.guided import GuideError
from dualpath.engines.sampler import sample
from grammar_check import along, allowed, check_masks_along, completes, read, schema, toy_guide, walk

JSON_MODE = schema()


def text(**kwargs):
    """Strings as llguidance writes them in JSON: with no raw DEL (0x7F: valid JSON, but it takes only "\\u007f")."""
    return st.text(st.characters(codec="utf-8", exclude_characters="\x7f"), **kwargs)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text(max_size=5), kids, max_size=4),
    max_leaves=12,
)
OBJECTS = st.dictionaries(text(max_size=5), JSON, max_size=5)
STYLES = st.sampled_from(
    [
        dict(),
        dict(indent=2),
        dict(indent=4, ensure_ascii=False),
        dict(separators=(",", ":")),
        dict(indent="\t", ensure_ascii=False),
    ]
)


def _no_constants(name):
    raise ValueError(name)


def parsed(data: bytes):
    """The oracle's parse: strict JSON (no NaN/Infinity, no raw control characters), or None."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except ValueError:
        return None


def parses_as_object(data: bytes) -> bool:
    """An object whose strings are Unicode text (json.loads also takes a lone surrogate's escape, "\\udc00",
    which no UTF-8 text holds: llguidance refuses it)."""
    value = parsed(data)
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return isinstance(value, dict)


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
    states = along(JSON_MODE, data)
    assert len(states) == len(data) + 1, f"rejected byte {len(states) - 1} of {data!r}"
    assert not any(r.complete for r in states[:-1]) and states[-1].complete, data


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
    cap, nothing after the object)."""
    data = mutated(json.dumps(obj, **style).encode(), random.Random(seed))
    n, r = walk(JSON_MODE, data)
    whole = n == len(data) and r.complete
    expect = parses_as_object(data) and ws_runs_ok(data) and data == data.rstrip()
    assert whole == expect, data


def test_limits():
    assert completes(JSON_MODE, b"{" + b" " * MAX_WS + b"}")
    assert read(JSON_MODE, b"{" + b" " * (MAX_WS + 1)) is None
    assert completes(JSON_MODE, b" " * MAX_WS + b"{}") and read(JSON_MODE, b" " * (MAX_WS + 1)) is None
    for bad in (b'{"a": 01}', b'{"a": 1.}', b'{"a": NaN}', b"[1]", b'{"a": "\x0a"}', b"{} ", b'"a"'):
        assert read(JSON_MODE, bad) is None, bad


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
    "strings": {
        **Account.model_json_schema(),
        "properties": {
            **Account.model_json_schema()["properties"],
            "quoted": {"type": "string", "pattern": '["\\\\ \n\u00e9a-c]{1,3}', "minLength": 2},
            "word": {"enum": ["ab", "abcd", 7], "maxLength": 3},
            "long": {"type": "string", "minLength": 3},
            "free": {"type": "string", "pattern": "[^x]{0,6}"},
        },
    },  # reads quotes, backslashes, controls like text
    "closed": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "kind": {"enum": ["a", "b", 3, None]},
            "xs": {"type": "array", "items": {"type": ["number", "null"]}},
        },
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "additionalProperties": False,
        "required": ["xs", "tags"],
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2},
            "none": {"type": "array", "maxItems": 0},
        },
    },
    "open": {
        "type": "object",
        "properties": {"n": {"type": "number"}},
        "required": ["n", "m"],
        "additionalProperties": {"type": "string"},
    },
    "choice": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"t": {"const": "x"}, "v": {"type": "integer"}},
                "required": ["t", "v"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"t": {"const": "y"}, "v": {"type": "string"}},
                "required": ["t", "v"],
                "additionalProperties": False,
            },
        ]
    },
    "numbers": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 3, "maximum": 70},
            "x": {"type": "number", "exclusiveMinimum": 0},
        },
        "required": ["n", "x"],
        "additionalProperties": False,
    },  # bounds the old engine could not enforce
}


def instances(schema, root=None, depth=0):
    """Hypothesis values valid against ``schema`` (test-side generator), their properties in the order llguidance
    writes them: the schema's ``properties``, then other required names, then other keys."""
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
        return _objects(schema, root, depth)
    if t == "array":
        least, most = schema.get("minItems", 0), schema.get("maxItems", 3 if depth < 3 else 0)
        return st.lists(
            instances(schema.get("items", True), root, depth + 1), min_size=least, max_size=max(least, most)
        )
    if t == "string" and ({"pattern", "minLength", "maxLength"} & set(schema)):
        return ruled_strings(schema)
    if t in ("integer", "number") and {"minimum", "maximum", "exclusiveMinimum"} & set(schema):
        lo, hi = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1), schema.get("maximum", 10**6)
        return st.integers(lo, hi) if t == "integer" else st.floats(lo, hi)
    return {
        "string": text(max_size=6),
        "integer": st.integers(-(10**9), 10**9),
        "boolean": st.booleans(),
        "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers(),
        "null": st.none(),
    }[t]


def _objects(schema, root, depth):
    props = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    order = [k for k in list(props) + [k for k in required if k not in props] if k in required or depth < 3]
    values = {
        k: instances(props[k], root, depth + 1) if k in props else instances(extra, root, depth + 1) for k in order
    }
    present = st.fixed_dictionaries({k: st.booleans() for k in order if k not in required})
    more = (
        st.just({})
        if extra is False or depth >= 3
        else st.dictionaries(
            text(max_size=4).filter(lambda k: k not in order), instances(extra, root, depth + 1), max_size=2
        )
    )

    def build(draw):
        chosen = draw(present)
        out = {k: draw(values[k]) for k in order if k in required or chosen.get(k)}
        return {**out, **draw(more)}

    return st.composite(lambda draw: build(draw))()


def ruled_strings(schema):
    """Strings satisfying a string schema's pattern (as a whole) and length bounds, written escaped or raw."""
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    strings = (
        st.from_regex(schema["pattern"], fullmatch=True)
        if "pattern" in schema
        else text(min_size=least, max_size=most if most is not None else least + 6)
    )
    bmp = strings.filter(lambda t: all(ord(c) <= 0xFFFF and c != "\x7f" for c in t))
    return bmp.filter(
        lambda t: (
            least <= len(t) <= (most if most is not None else len(t))
            and ("pattern" not in schema or re.fullmatch(schema["pattern"], t, re.ASCII))
        )
    )


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_instances_are_accepted_and_mutations_that_complete_are_valid(name):
    s = SCHEMAS[name]
    c = schema(s)
    validator = jsonschema.Draft202012Validator(s)

    @settings(max_examples=75, deadline=None)
    @given(instances(s), STYLES, st.integers(0, 2**32))
    def check(value, style, seed):
        # a string under a pattern spells other characters than ASCII raw (llguidance takes \u escapes there for
        # control characters only)
        data = json.dumps(value, **{**style, "ensure_ascii": style.get("ensure_ascii", True) and name != "strings"})
        data = data.encode()
        assert completes(c, data), data
        bad = mutated(data, random.Random(seed), b'{}[]":,-.0123456789etrufalsn \nabxyz')
        if completes(c, bad):
            assert validator.is_valid(parsed(bad)), bad

    check()


@pytest.mark.parametrize(
    "s, words",
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)x"}}}, "look-around"),
        ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum (5) is greater than maximum (3)"),
        ({"not": {"type": "object"}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"type": "object", "required": ["b"], "additionalProperties": False}, "'b' is unsatisfiable"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}}, "does not exist"),
        ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "http://x/y"),
        ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}, "matches nothing"),
        ({"type": "object", "properties": {"a": {"type": "date"}}}, "date"),
        ("object", "must be an object or boolean"),
    ],
)
def test_schemas_that_cannot_be_enforced_are_refused(s, words):
    with pytest.raises(GrammarError, match=re.escape(words)) as e:
        check(schema(s))
    assert e.value.field == "response_format" and str(e.value).startswith("response_format: ")


KEYWORDS = st.sampled_from(
    [
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "enum",
        "const",
        "anyOf",
        "allOf",
        "$ref",
        "$defs",
        "title",
        "minLength",
        "oneOf",
    ]
)
SCHEMA_LIKE = st.recursive(
    JSON | st.sampled_from(["object", "array", "string", "#", "#/$defs/a", "#/properties/a"]),
    lambda kids: st.dictionaries(KEYWORDS | st.sampled_from(["a", "b"]), kids, max_size=4) | st.lists(kids, max_size=3),
    max_leaves=10,
)


@settings(max_examples=250, deadline=None)
@given(SCHEMA_LIKE)
@example({"type": [[]], "enum": [None]})  # found by this test: an unhashable type name was a TypeError (a 500)
@example({"type": [{}], "properties": {}})
def test_any_schema_compiles_or_is_refused_with_a_grammar_error(s):
    try:
        check(schema(s))
    except GrammarError as e:
        assert e.field == "response_format"
        return
    assert not compile(schema(s)).is_error()


def test_compiling_is_bounded_by_a_time_limit(monkeypatch):
    """A compile that takes longer than its limit (here one made slow) is a GrammarError naming the field; the
    compile runs on to its end on a thread of its own, and nobody waits for it."""
    from dualpath.core import structured

    real = structured._matcher
    monkeypatch.setattr(structured, "_matcher", lambda tok, text: time.sleep(0.5) or real(tok, text))
    with pytest.raises(GrammarError, match="took longer than 0.05 s") as e:
        compile(schema(SCHEMAS["closed"]), seconds=0.05)
    assert e.value.field == "response_format"
    assert not compile(schema(SCHEMAS["closed"])).is_error()  # given the default limit, it compiles


def test_schema_rules():
    c = schema(SCHEMAS["closed"])
    assert completes(c, b'{"id": 3, "kind": null}') and completes(c, b'{"id": -0, "kind": "b", "xs": [1.5, null]}')
    for bad in (
        b'{"id": 3}',
        b'{"id": 3.0, "kind": 3}',
        b'{"id": 1, "kind": "c"}',
        b'{"id": 1, "kind": 3, "z": 1}',
        b'{"id": 1, "id": 2, "kind": 3}',
        b'{"id": 1, "kind": "\\u0061"}',
    ):
        assert not completes(c, bad), bad
    open_ = schema(SCHEMAS["open"])
    assert completes(open_, b'{"n": 1e5, "m": "x", "zz": "y"}') and not completes(open_, b'{"n": 1}')
    assert not completes(open_, b'{"n": 1, "m": 2}')
    bounded = schema(SCHEMAS["bounded"])
    assert completes(bounded, b'{"xs": [1], "tags": ["a", "a"]}')
    assert completes(bounded, b'{"xs":[1,2,3],"tags":["b","a","b"],"none":[]}')
    for bad in (
        b'{"xs": [], "tags": ["a", "a"]}',
        b'{"xs": [1, 2, 3, 4], "tags": ["a", "b"]}',
        b'{"xs": [1], "tags": ["a"]}',
        b'{"xs": [1], "tags": ["a", "b"], "none": [1]}',
    ):
        assert not completes(bounded, bad), bad
    choice = schema(SCHEMAS["choice"])
    assert completes(choice, b'{"t": "x", "v": 3}') and completes(choice, b'{"t": "y", "v": "3"}')
    assert not completes(choice, b'{"t": "x", "v": "3"}')
    numbers = schema(SCHEMAS["numbers"])
    assert completes(numbers, b'{"n": 3, "x": 0.5}') and completes(numbers, b'{"n": 70, "x": 1000.5}')
    for bad in (b'{"n": 2, "x": 1}', b'{"n": 71, "x": 1}', b'{"n": 5, "x": 0}', b'{"n": 5, "x": -1}'):
        assert not completes(numbers, bad), bad


def test_properties_come_in_the_schemas_order():
    """llguidance writes an object's properties in its schema's order (then other required names, then other keys),
    as OpenAI's structured outputs do: the old engine also took them in any order."""
    c = schema(SCHEMAS["closed"])
    assert completes(c, b'{"id": 3, "kind": null}') and read(c, b'{"kind": null, "id": 3}') is None
    open_ = schema(SCHEMAS["open"])
    assert completes(open_, b'{"n": 1, "m": "x", "zz": "y"}') and read(open_, b'{"m": "x", "n": 1}') is None


def test_top_level_values_other_than_objects_are_answers_too():
    """A schema's top level may be any type (vLLM's guided_json takes them): a string ends with its quote, a
    number may read on, so the end token ends it."""
    assert completes(schema({"type": "string"}), b'"a b"')
    r = read(schema({"type": "integer"}), b"12")
    assert r.may_end and not r.complete
    assert read(schema({"type": "array", "items": {"type": "boolean"}}), b"[true, 1") is None


# --- masks over a vocabulary ---------------------------------------------------------------------------------


def toy_vocab() -> list:
    """Every byte, multi-byte tokens with several closers, escapes and literals, and special tokens (None)."""
    multi = [
        b"}}",
        b"]}",
        b"}]",
        b'"}',
        b'"]}',
        b"}}}",
        b'": "',
        b'", "',
        b'":',
        b"\\n",
        b'\\"',
        b"\\u00",
        b"true",
        b"false",
        b"null",
        b"truefalse",
        b"0.5e",
        b"-1",
        b"12",
        b'{"',
        b"[[",
        b"[]",
        b"{}",
        b"  ",
        b"\n  ",
        b"\n    ",
        b"}\n",
        b"1}",
        b'"a"',
        b"e+",
        b"\xc3\xa9",
        b"\xc3",
        b", ",
        b":[",
        b"],",
        b"},{",
        b'"name',
        b'"street": "',
        b'admin"',
        b'"tags": ["',
        b"ity",
        b"age",
        b"abcd",
        b"\xc3\xa9t\xc3\xa9",
        b"ab_9",
        b"@a.com",
        b"\\u00e9",
        b'\\"',
        b"AB12",
    ]
    return [bytes([b]) for b in range(256)] + multi + [None, None]


@pytest.mark.parametrize("name", ["json", "pydantic", "choice", "bounded", "strings"])
def test_masks_equal_a_check_of_every_token(name):
    vocab = toy_vocab()
    if name == "json":
        c = JSON_MODE
        deep = {"a": [[[[{"b": [{"c": {"d": [1, -2.5e-3, "x\\u00e9\n", True, None]}}]}]]]], "e": {}, "f": []}
        docs = [json.dumps(deep).encode(), b'{"k": [[[[[]]]]],\n  "z": 0}']
    elif name == "pydantic":
        c = schema(SCHEMAS["pydantic"])

        def kid(friends):  # (the properties in the schema's order)
            return {
                "name": "b",
                "age": 2,
                "height": 1.5,
                "tags": [],
                "address": {"street": "s", "city": "c"},
                "friends": friends,
                "active": False,
            }

        person = {
            "name": "a\u00e9",
            "age": 3,
            "height": 1e2,
            "tags": ["admin", "guest"],
            "address": {"street": "s", "city": "c", "zip": None},
            "friends": [kid([kid([kid([])])])],
            "active": True,
            "note": "n",
        }
        docs = [json.dumps(person, indent=1).encode()]
    elif name == "strings":
        c = schema(SCHEMAS["strings"])
        docs = [
            b'{"handle": "ab_9", "display": "\xc3\xa9t\xc3\xa9 \\u00e9\\n", "email": "a.b@ab.org", "code": "AB12", '
            b'"quoted": "\\"\\\\", "word": "ab", "long": "abcd\\"\\u00e9", "free": "ab\\"\xc3\xa9t\\n"}',
            b'{"handle":"z99","display":"abcdabcdabcd","email":"x@y.com","code":null,"note":"abc",'
            b'"quoted":"\xc3\xa9a"}',
        ]
    elif name == "choice":
        c = schema(SCHEMAS["choice"])
        docs = [b'{"t": "x", "v": 3}', b'{ "t" : "y" , "v" : "3" }']
    else:
        c = schema(SCHEMAS["bounded"])
        docs = [b'{"xs": [1, 22, 333], "tags": ["a", "b", "a", "a"], "none": []}', b'{"xs":[7],"tags":["b","b"]}']
    seen = sum(check_masks_along(c, vocab, doc, len(vocab) + 3) for doc in docs)
    assert seen > 30


def test_a_guide_follows_its_tokens_and_refuses_others():
    vocab = toy_vocab()
    width = len(vocab)
    g = toy_guide(JSON_MODE, vocab, width)
    ids = {t: i for i, t in enumerate(vocab) if t is not None}
    for tok in [b'{"', b"a", b'": "', b"x", b'"', b",", b" ", b'"a"', b":[", b"true", b"]}"]:
        assert allowed(g, width)[ids[tok]]
        g.advance(ids[tok])
    assert g.complete
    g2 = toy_guide(JSON_MODE, vocab, width)
    with pytest.raises(GuideError):
        g2.advance(ids[b"["])
    g3 = toy_guide(JSON_MODE, vocab, width)
    with pytest.raises(GuideError):
        g3.advance(len(vocab) - 1)  # a special token


def test_random_walks_over_masks_end_valid():
    """What sampling under masks does, with a model that picks at random among allowed tokens (leaning to ones
    that close things): every walk that completes is valid against its schema."""
    vocab = toy_vocab()
    width = len(vocab)
    closing = torch.tensor([t is not None and any(c in t for c in b'"}]') for t in vocab])
    ended = 0
    for name in ("json", "pydantic", "closed", "open", "choice", "bounded", "strings", "numbers"):
        c = JSON_MODE if name == "json" else schema(SCHEMAS[name])
        validator = jsonschema.Draft202012Validator({"type": "object"} if name == "json" else SCHEMAS[name])
        rng = torch.Generator().manual_seed(0)
        for _ in range(8):
            guide, out = toy_guide(c, vocab, width), b""
            for _ in range(400):
                m = allowed(guide, width)
                pool = m & closing if (m & closing).any() and torch.rand(1, generator=rng) < 0.6 else m
                tok = int(pool.nonzero()[torch.randint(int(pool.sum()), (1,), generator=rng)])
                guide.advance(tok)
                out += vocab[tok]
                if guide.complete:
                    assert validator.is_valid(parsed(out)), out
                    ended += 1
                    break
    assert ended >= 25


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([None, r"[a-c]+", r"\d{2,4}", r"(ab|\n\")*x?", r"[^\x00-\x60]{1,3}", "é|[\\\\/]{2}"]),
    st.integers(0, 4),
    st.one_of(st.none(), st.integers(0, 6)),
    st.randoms(use_true_random=False),
)
def test_ruled_strings_never_reach_a_dead_end(pattern, least, most, rng):
    """Random bytes among those a state allows, inside a string with a pattern and/or length bounds (escapes,
    \\u escapes and raw UTF-8 included): every state reached allows some byte, and what completes is valid."""
    rule = {k: v for k, v in (("pattern", pattern), ("minLength", least), ("maxLength", most)) if v is not None}
    s = {
        "type": "object",
        "properties": {"s": {"type": "string", **rule}},
        "required": ["s"],
        "additionalProperties": False,
    }
    try:
        check(schema(s))
    except GrammarError:
        assume(most is not None and most < least or pattern is not None)  # unsatisfiable pairs only
        return
    matcher = compile(schema(s))
    out = b'{"s": "'
    assert all(matcher.consume_token(b) for b in out)
    for _ in range(60):
        mask = matcher.compute_bitmask()  # (one token a byte: bit b of the mask)
        nxt = [b for b in range(256) if mask[b // 8] >> (b % 8) & 1]
        assert nxt, (s, out)  # never a dead end
        b = rng.choice([x for x in nxt if x in b'"}'] or nxt) if rng.random() < 0.3 else rng.choice(nxt)
        assert matcher.consume_token(b)
        out += bytes([b])
        if matcher.is_stopped():
            assert jsonschema.Draft202012Validator(s).is_valid(parsed(out)), out
            break


# --- thinking first: a reasoning model's think block, then the output --------------------------------------------

FORCED = ("<tool_call>\n", "\n</tool_call>")  # a forced call's markup around its object
THINK_TOKENS = [
    b"<think>",
    b"</think>",
    b"</",
    b"think>",
    b"k>",
    b">",
    b"</think>\n\n",
    b'k>{"',
    b"k>\n<tool_call>",
    b"</think>{}",
    b"\n<think>\n",
    b"x>",
    b"<<",
]


@pytest.mark.parametrize(
    "thinking, text, ok",
    [
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
    ],
)
def test_thinking_before_the_object(thinking, text, ok):
    assert completes(schema(thinking=thinking), text) == ok
    forced = schema(None, *FORCED, thinking=thinking)
    marked = text.replace(b'{"a": 1}', FORCED[0].encode() + b'{"a": 1}' + FORCED[1].encode())
    assert completes(forced, marked) == ok and not completes(forced, text)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40), OBJECTS, st.sampled_from(["open", "optional"]))
def test_any_thought_then_any_object_completes_only_at_its_end(thought, obj, thinking):
    """Any text (the thinking is free: valid UTF-8, as a tokenizer's text is), then an object."""
    head = b"" if thinking == "open" else b"<think>"
    data = head + thought.replace("</think>", "").encode() + b"</think>\n" + json.dumps(obj).encode()
    states = along(schema(thinking=thinking), data)
    assert len(states) == len(data) + 1 and not any(r.complete for r in states[:-1]) and states[-1].complete


@pytest.mark.parametrize("thinking", ["open", "optional"])
def test_thinking_masks_equal_a_check_of_every_token(thinking):
    vocab = toy_vocab() + THINK_TOKENS
    for prefix, suffix in (("", ""), FORCED):
        c = schema(SCHEMAS["closed"], prefix, suffix, thinking)
        head = b"" if thinking == "open" else b" <think>"
        doc = head + b"x </thi<</think>\n\n" + prefix.encode() + b'{"id": 1, "kind": "a"}' + suffix.encode()
        check_masks_along(c, vocab, doc, len(vocab) + 2)


def test_random_walks_think_then_end_valid():
    """Walks that close the thought when they happen to spell </think> (leaning to its next byte), then write the
    object: every one that completes is a thought and a valid object."""
    vocab = toy_vocab() + THINK_TOKENS
    width = len(vocab)
    ids = {t: i for i, t in enumerate(vocab) if t is not None}
    validator = jsonschema.Draft202012Validator(SCHEMAS["closed"])
    c = schema(SCHEMAS["closed"], thinking="open")
    closing = torch.tensor([t is not None and any(x in t for x in b'"}]') for t in vocab])
    rng, ended = torch.Generator().manual_seed(0), 0
    for _ in range(20):
        guide, out = toy_guide(c, vocab, width), b""
        for _ in range(400):
            m = allowed(guide, width)
            thinking = b"</think>" not in out
            matched = next((k for k in range(7, 0, -1) if out.endswith(b"</think>"[:k])), 0)
            close = ids[b"</think>"[matched : matched + 1]]
            if thinking and torch.rand(1, generator=rng) < 0.5 and m[close]:  # (not inside a character)
                tok = close
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


def test_a_vocabulary_past_the_tokenizer_never_offers_its_extra_ids():
    """A model's logits may outnumber its tokenizer's ids (padded vocabularies): those ids are never allowed, and
    the model's end token is the one given."""
    vocab = [bytes([b]) for b in range(256)] + [None]
    guide = toy_guide(schema({"type": "integer"}), vocab, 300, end_ids=[256])
    m = allowed(guide, 300)
    assert m[ord("1")] and not m[256] and not m[257:].any()
    guide.advance(ord("1"))
    m = allowed(guide, 300)
    assert m[256] and not m[257:].any()  # a number may read on, or end
    guide.advance(256)
    assert guide.complete


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


def test_bitmask_rows_sample_as_their_boolean_masks():
    """The engines' masks come as llguidance's bitmasks (int32 words, bit t % 32 of word t // 32): unpacked in the
    sampler, a row samples as with the same boolean mask, beside boolean and unmasked rows."""
    torch.manual_seed(1)
    b, v = 5, 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(b, v) * 4
    bools = [torch.rand(v) < 0.3 for _ in range(b)]
    for m in bools:
        m[3] = True
    packed = []
    for m in bools:
        words = [0] * ((v + 31) // 32)
        for t in m.nonzero().flatten().tolist():
            words[t // 32] |= 1 << (t % 32)
        packed.append(torch.tensor([w - (1 << 32) if w >> 31 else w for w in words], dtype=torch.int32))
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 1.0, 0.7, 0, 1.0])]
    mixed = [packed[0], bools[1], packed[2], None, packed[4]]
    want = [bools[0], bools[1], bools[2], None, bools[4]]
    got, _ = sample(logits, params, [_gen(p) for p in params], mixed)
    assert got == sample(logits, params, [_gen(p) for p in params], want)[0]
    assert all(m is None or m[t] for m, t in zip(want, got))


def _gen(p: SamplingParams):
    from dualpath.engines.sampler import make_generator

    return make_generator(p)


# --- whole generations -----------------------------------------------------------------------------------------


def test_tiny_model_json_mode_outputs_valid_json_object_prefixes(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    prompts = ["hello", "give me json", "a b c d e f"]
    for params in (
        SamplingParams(temperature=0, max_tokens=300, json_object=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=300, json_object=True),
    ):
        outs = llm.generate(prompts, params)
        for o in outs:
            data = bytes(o.token_ids)  # the tiny tokenizer: one token per byte
            state = read(JSON_MODE, data)
            assert state is not None, data
            if o.finish_reason == "stop":
                assert parses_as_object(data), data
            else:
                assert o.finish_reason == "length" and len(o.token_ids) == 300
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    assert any(read(JSON_MODE, bytes(o.token_ids)) is None for o in free)  # unconstrained, it is not JSON


def test_tiny_model_schema_outputs_are_valid(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    validator = jsonschema.Draft202012Validator(SCHEMAS["closed"])
    stopped = 0
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, json_schema=json.dumps(SCHEMAS["closed"]))
        for o in llm.generate(["a", "bb", "ccc"], params):
            data = bytes(o.token_ids)
            assert read(schema(SCHEMAS["closed"]), data) is not None
            if o.finish_reason == "stop":
                stopped += 1
                assert validator.is_valid(parsed(data)), data
    assert stopped >= 3


@pytest.mark.slow  # (~10 s; schemas and patterns through the tiny model run by default in the tests above)
def test_tiny_model_strings_follow_their_patterns_and_lengths(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": r"^[A-F0-9]{4}-\d{2}$"},
            "tag": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    validator = jsonschema.Draft202012Validator(schema)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=300, json_schema=json.dumps(schema)) for seed in range(3)
    ]
    outs = [o for p in params for o in llm.generate(["a", "bb"], p)]
    assert sum(o.finish_reason == "stop" for o in outs) >= 3  # a random model writes much whitespace
    for o in outs:
        assert o.finish_reason == "length" or validator.is_valid(parsed(bytes(o.token_ids))), o.text


def test_tiny_model_thinks_freely_then_writes_json(tiny_dirs):
    """A thought is not constrained: until it writes </think>, a reply that thinks first is the model's own
    (greedy: what it writes unconstrained, among tokens that have text) as long as that is text (UTF-8: the random
    model writes broken characters, which llguidance's free text does not take); the JSON comes after."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    prompts = ["hello", "a b c d e f", "think first"]
    texts = [i for i, t in enumerate(Tokenizer(tiny_dirs["llama"]).token_bytes) if t]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, allowed_token_ids=texts))
    thought = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, json_object=True, json_thinking="open")
    )
    same = 0
    for f, o in zip(free, thought):
        text = _utf8_prefix(bytes(f.token_ids))  # the tiny tokenizer: a token a byte
        assert b"</think>" not in bytes(f.token_ids) and o.token_ids[: len(text)] == f.token_ids[: len(text)]
        same += len(text)
    assert same >= 8
    json_first = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, json_object=True))
    assert all(read(JSON_MODE, bytes(o.token_ids)) is not None for o in json_first)
    assert [o.token_ids for o in json_first] != [o.token_ids for o in thought]
    optional = schema(thinking="optional")
    for o in llm.generate(
        prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=40, json_object=True, json_thinking="optional")
    ):
        assert read(optional, bytes(o.token_ids)) is not None


def _utf8_prefix(data: bytes) -> bytes:
    """The longest prefix of ``data`` that some UTF-8 text begins with."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    for i in range(len(data)):
        try:
            decoder.decode(data[i : i + 1])
        except UnicodeDecodeError:
            return data[:i]
    return data


@pytest.mark.parametrize("markup", ["hermes", "llama3", "deepseek_v3"])
def test_forced_tool_calls_from_a_model_parse_as_one_valid_call(tiny_dirs, markup):
    """tool_choice "required" as the engines run it: the markup's text around a call object; every reply that
    stops is one call to one of the tools, its arguments valid against that tool's parameters."""
    from dualpath.serving.tools import DeepSeekV3, Hermes, Llama3Json, ToolCallSplitter

    # no free strings: a random model rarely closes one within the token budget
    functions = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"days": {"type": "integer"}},
                "required": ["days"],
                "additionalProperties": False,
            },
        },
        {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    ]
    m = {"hermes": Hermes(), "llama3": Llama3Json(), "deepseek_v3": DeepSeekV3()}[markup]
    shape = m.forced(functions)  # DeepSeek's names the function before the arguments: a branch per function
    assert (shape.prefix, shape.suffix) == {"hermes": ("<tool_call>\n", "\n</tool_call>"), "llama3": ("", "")}.get(
        markup, (shape.prefix, shape.suffix)
    )
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
    chats = [
        [
            {"role": "system", "content": "Reply in JSON."},
            {"role": "user", "content": "Give a person with name and age as JSON."},
        ],
        [{"role": "user", "content": "List three colors."}],
    ]
    for o in llm.chat(chats, SamplingParams(temperature=0, max_tokens=120, json_object=True)):
        assert o.finish_reason == "stop", o.text
        assert isinstance(json.loads(o.text), dict), o.text
    free = llm.chat(chats[1:], SamplingParams(temperature=0, max_tokens=40))[0].text
    assert not parses_as_object(free.encode())
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"enum": ["Paris", "London", "Rome"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
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
    sp.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp.add_special_tokens([AddedToken("<s>", special=True)])
    sp_bytes = _write(sp, tmp_path / "sp").token_bytes
    assert sp_bytes[0x41] == b"A" and sp_bytes[0xC3] == b"\xc3" and sp_bytes[256] == b" hi"
    assert sp_bytes[258] == b"lo" and sp_bytes[259] is None

    wp = HF(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.decoder = decoders.WordPiece()
    with pytest.raises(CheckpointError, match="byte-level"):
        _write(wp, tmp_path / "wp").token_bytes


def test_an_engine_indexes_the_vocabulary_off_its_loop(tiny_dirs):
    """The first structured request: ``guides_ready`` returns at once and the vocabulary pass runs on a
    helper thread, which then hands the work back; later requests (and unconstrained ones) go straight through. A
    pass that fails still hands the work back, and the request then fails with the reason."""
    import threading
    import time
    from types import SimpleNamespace

    from dualpath.engines.engine import Engine
    from dualpath.engines.guided import GuideSource

    tok = Tokenizer(tiny_dirs["llama"])

    def slow():
        time.sleep(0.5)
        return tok

    engine = SimpleNamespace(guides=GuideSource(slow, 320))
    json_mode, free = SamplingParams(json_object=True), SamplingParams()
    back = threading.Event()
    t0 = time.perf_counter()
    assert not Engine.guides_ready(engine, json_mode, back.set)
    assert time.perf_counter() - t0 < 0.2 and Engine.guides_ready(engine, free, None)
    assert back.wait(10) and Engine.guides_ready(engine, json_mode, None)
    assert engine.guides.guide_for(json_mode) is not None

    def broken():
        raise CheckpointError("no token bytes")

    engine = SimpleNamespace(guides=GuideSource(broken, 320))
    back.clear()
    assert not Engine.guides_ready(engine, json_mode, back.set) and back.wait(10)
    assert Engine.guides_ready(engine, json_mode, None)  # the work goes on, to fail (no pass retried in a loop)
    with pytest.raises(CheckpointError, match="no token bytes"):
        engine.guides.guide_for(json_mode)


def test_an_offline_grammar_llguidance_never_comes_back_from_is_refused_and_the_engine_serves_on(
    tiny_dirs, monkeypatch
):
    """The offline ``LLM`` has no frontend to check its constraints: its engine runs the same check (a process of its
    own, killed past the limit) before it compiles one. A grammar whose first mask never returns (two greedy lexemes
    of one language in a row) is a GrammarError within the limit, no thread is left spinning, and the next request is
    served."""
    import threading

    from dualpath.core import structured

    monkeypatch.setattr(structured, "COMPILE_SECONDS", 1.0)
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    threads = threading.active_count()
    start = time.monotonic()
    with pytest.raises(GrammarError, match="took longer than 1 s"):
        llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=8, grammar='root ::= r r\nr ::= "a"+'))
    assert time.monotonic() - start < 10 and threading.active_count() == threads
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=8, grammar='root ::= "a"+'))[0]
    assert out.token_ids and set(bytes(t for t in out.token_ids if t < 256)) <= {ord("a")}
