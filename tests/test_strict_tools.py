"""Strict tools under ``tool_choice`` "auto" (OpenAI's strict function calling): the reply's text stays free and
each call it begins is held to the tools' schemas (``Grammar(trigger=True)``: free text in which a trigger begins a
constrained object). The grammar against hand-checked texts, its masks against a token-by-token check, whole
generations of the tiny random model whose every triggered object is valid, and the frontend's sampling fields."""
import json

import jsonschema
import pytest

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.grammar import Grammar
from dualpath.serving.tools import DeepSeekV3, Hermes
from engines.guided import GrammarMasks, Vocabulary
from test_tools import HERMES_TEMPLATE, LLAMA3_TEMPLATE, WEATHER, chat, serve

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                           "days": {"type": "integer"}},
          "required": ["city"], "additionalProperties": False}
FUNCTIONS = [{"name": "get_weather", "parameters": PARAMS}, {"name": "get_time", "parameters": {"type": "object"}}]


def hermes_grammar() -> Grammar:
    shape = Hermes().triggered(FUNCTIONS)
    return Grammar.compile(shape.schema, shape.prefix.encode(), shape.suffix.encode(), trigger=True)


@pytest.mark.parametrize("text, ok, may_end", [
    ("Just text, <b>tags</b> and <tool_ a false start.", True, True),
    ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>', True,
     True),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call> then '
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> done', True, True),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', True, False),  # inside a call: no end
    ('a <<tool_call>{"name": "get_weather", "arguments": {"city": "Par', True, False),  # the match restarts
    ('<tool_call>{"name": "launch", "arguments": {}}', False, False),  # not a tool
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', False, False),  # not in the enum
    ('<tool_call>{"name": "get_weather", "arguments": {"days": 2}}', False, False),  # city is required
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', False, False),  # the newline
])
def test_free_text_with_calls_held_to_their_schemas(text, ok, may_end):
    g = hermes_grammar()
    state = g.run(g.start, text.encode())
    assert (state is not None) == ok
    if ok:
        assert Grammar.may_end(state) == may_end and not Grammar.complete(state)


def test_a_trigger_must_restart_cleanly():
    with pytest.raises(ValueError, match="first byte occurs once"):
        Grammar.json_object(b"abca", b"", trigger=True)
    with pytest.raises(ValueError):
        Grammar.json_object(b"", b"", trigger=True)


@pytest.mark.parametrize("text", ["", "see <too", "see <tool_call", "x<tool_call>", '<tool_call>{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo"}}\n</tool', '<tool_call>{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo"}}\n</tool_call>\n'])
def test_masks_in_and_around_calls_equal_a_token_by_token_check(text):
    """In free text every token but those with the trigger's last byte is allowed without reading it; those, and
    every token inside a call, are read; the end token is allowed exactly where the text is free."""
    tokens = [bytes([b]) for b in range(256)] + [b"<tool_call>", b"_call>", b"_call>\n{", b'>{"name": "get_',
                                                 b"call>{", b"ol_call", b'"}}\n</tool_call>', b"></", b"\n</"]
    vocab = Vocabulary(tokens + [None], len(tokens) + 1, end_ids=[len(tokens)])
    g = hermes_grammar()
    state = g.run(g.start, text.encode())
    mask = GrammarMasks(g, vocab, "cpu").mask(state)
    want = [g.run(state, t) is not None for t in tokens] + [Grammar.may_end(state)]
    assert mask.tolist() == want


def test_tiny_model_replies_keep_every_triggered_object_valid(tiny_dirs):
    """A one-character trigger the model is pushed towards (a logit bias): the replies are free text with objects
    after each "@", every one valid against the schema and closed by the suffix before the text goes on."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    calls = 0
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120, json_schema=json.dumps(PARAMS),
                                json_prefix="@", json_suffix="!", json_trigger=True, logit_bias=((ord("@"), 4.0),))
        for o in llm.generate(["hello", "x y"], params):
            ids = o.token_ids[:-1] if o.token_ids[-1] == EOS_ID else o.token_ids
            text = bytes(ids).decode("utf-8", "replace")  # the tiny tokenizer: a token a byte
            g = Grammar.compile(PARAMS, b"@", b"!", trigger=True)
            assert g.run(g.start, bytes(ids)) is not None, text
            for part in text.split("@")[1:]:
                body, closed, _ = part.partition("!")
                if closed:  # a whole object (a cut reply's last one may be open)
                    jsonschema.validate(json.loads(body), PARAMS)
                    calls += 1
    assert calls >= 3


# --- the frontend ----------------------------------------------------------------------------------------------
def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def test_strict_tools_hold_the_calls_of_an_auto_reply(tiny_dirs, tmp_path):
    """A strict tool under "auto": the calls are constrained and the text is free (a trigger); a tool that is not
    strict beside it takes any object; no strict tool: nothing constrained; "required" still forces one call; a
    strict tool whose schema cannot be enforced is a 400; Llama 3's markup (calls are the whole reply) is not
    constrained."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = "Sunny."
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}
    ask = dict(messages=[{"role": "user", "content": "Weather?"}])
    assert chat(http, **ask, tools=[strict(WEATHER), other]).status_code == 200
    s = fake.samplings[-1]
    assert s.json_trigger and s.json_prefix == "<tool_call>" and s.json_suffix == "\n</tool_call>"
    alts = json.loads(s.json_schema)["anyOf"]
    assert [a["properties"]["arguments"] for a in alts] == [WEATHER["function"]["parameters"], {"type": "object"}]
    assert chat(http, **ask, tools=[WEATHER]).status_code == 200 and not fake.samplings[-1].structured
    assert chat(http, **ask, tools=[strict(WEATHER)], tool_choice="required").status_code == 200
    assert not fake.samplings[-1].json_trigger and fake.samplings[-1].json_prefix == "<tool_call>\n"
    bad = strict({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}}})
    r = chat(http, **ask, tools=[bad])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "minimum" in r.json()["error"]["message"]
    (tmp_path / "llama").mkdir()
    http, fake, _ = serve(tiny_dirs, tmp_path / "llama", LLAMA3_TEMPLATE)
    fake.reply = "Sunny."
    assert chat(http, **ask, tools=[strict(WEATHER)]).status_code == 200 and not fake.samplings[-1].structured


B, E, C, S, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", \
    "<｜tool▁call▁end｜>"


@pytest.mark.parametrize("code_block", [True, False])
def test_deepseek_calls_name_their_function_first_each_branch_holding_its_own_schema(code_block):
    """DeepSeek writes the name before the arguments: after the call's begin tag the text is one function's name
    (a branch), then that function's arguments: another's schema, or a name not offered, is refused."""
    shape = DeepSeekV3(code_block).triggered(FUNCTIONS)
    g = Grammar.compile(shape.schema, shape.prefix.encode(), shape.suffix.encode(), trigger=True,
                        branches=tuple(b.encode() for b in shape.branches))

    def call(name, args):
        return C + (f"function{S}{name}\n```json\n{args}\n```" if code_block else f"{name}{S}{args}") + CE
    text = "Let me look." + B + call("get_weather", '{"city": "Oslo"}') + call("get_time", '{"zone": 1}') + E + " Ok"
    state = g.run(g.start, text.encode())
    assert state is not None and Grammar.may_end(state)
    assert g.run(g.start, (B + call("get_weather", '{"zone": 1}')).encode()) is None  # get_time's arguments
    assert g.run(g.start, (B + call("launch", "{}")).encode()) is None
    assert not Grammar.may_end(g.run(g.start, (B + call("get_weather", '{"city": "Oslo"}')[:-3]).encode()))


def test_deepseek_strict_tools_reach_the_sampling_parameters(tiny_dirs, tmp_path):
    from test_tools import DEEPSEEK31_TEMPLATE

    http, fake, _ = serve(tiny_dirs, tmp_path, DEEPSEEK31_TEMPLATE)
    fake.reply = "Sunny."
    assert chat(http, messages=[{"role": "user", "content": "Weather?"}], tools=[strict(WEATHER)]).status_code == 200
    s = fake.samplings[-1]
    assert s.json_trigger and s.json_prefix == C and s.json_branches == (f"get_weather{S}",) and s.json_suffix == CE


def test_vllms_structural_tag_format_holds_what_each_trigger_begins(tiny_dirs, tmp_path):
    """response_format structural_tag (vLLM's): free text; a trigger begins one structure (the rest of its begin,
    an object of its schema, its end). One trigger and one end are what the grammar holds; other forms are a 400
    saying so. With tools it is allowed (it is how a custom call format is held)."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = "ok"
    fmt = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": PARAMS, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": {"type": "object", "properties": {"zone": {"type": "string"}}},
         "end": "</function>"}]}
    ask = dict(messages=[{"role": "user", "content": "hi"}])
    assert chat(http, **ask, response_format=fmt).status_code == 200
    s = fake.samplings[-1]
    assert s.json_trigger and s.json_prefix == "<function=" and s.json_branches == ("get_weather>", "get_time>")
    g = Grammar.compile(json.loads(s.json_schema), s.json_prefix.encode(), s.json_suffix.encode(), trigger=True,
                        branches=tuple(b.encode() for b in s.json_branches))
    text = 'Sure. <function=get_time>{"zone": "UTC"}</function> and <function=get_weather>{"city": "Oslo"}</function>'
    assert Grammar.may_end(g.run(g.start, text.encode()))
    assert g.run(g.start, b'<function=get_time>{"city": "Oslo"}') is not None  # get_time takes any properties
    assert g.run(g.start, b'<function=get_weather>{"zone": "UTC"}') is None
    assert chat(http, **ask, response_format=fmt, tools=[WEATHER]).status_code == 200
    for bad in ({**fmt, "triggers": ["<a", "<b"]}, {**fmt, "structures": [{**fmt["structures"][0], "end": "!"},
                                                                          fmt["structures"][1]]},
                {**fmt, "triggers": ["<function"], "structures": [{**fmt["structures"][0], "begin": "<fn=x>"}]},
                {"type": "structural_tag", "triggers": ["<f"]}):
        r = chat(http, **ask, response_format=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
