"""Strict tools under ``tool_choice`` "auto" (OpenAI's strict function calling): the reply's text stays free and
each call it begins is held to the tools' schemas (a constraint with a trigger: free text in which a trigger begins a
constrained object). The constraint against hand-checked texts, its masks against a token-by-token check, whole
generations of the tiny random model whose every triggered object is valid, and the frontend's sampling fields."""

import json

import jsonschema
import pytest

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import EOS_ID
from dualpath.serving.tools import DeepSeekV3, Hermes
from grammar_check import check_masks_along, constraint, read, schema
from test_tools import HERMES_TEMPLATE, LLAMA3_TEMPLATE, WEATHER, chat, serve

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTIONS = [{"name": "get_weather", "parameters": PARAMS}, {"name": "get_time", "parameters": {"type": "object"}}]


def hermes_grammar():
    shape = Hermes().triggered(FUNCTIONS)
    return schema(shape.schema, shape.prefix, shape.suffix, trigger=True)


@pytest.mark.parametrize(
    "text, ok, may_end",
    [
        ("Just text, <b>tags</b> and <tool_ a false start.", True, True),
        (
            'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
            True,
            True,
        ),
        (
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call> then '
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> done',
            True,
            True,
        ),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', True, False),  # inside a call: no end
        ('a <<tool_call>{"name": "get_weather", "arguments": {"city": "Par', True, False),  # the match restarts
        ('<tool_call>{"name": "launch", "arguments": {}}', False, False),  # not a tool
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', False, False),  # not in the enum
        ('<tool_call>{"name": "get_weather", "arguments": {"days": 2}}', False, False),  # city is required
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', False, False),  # the newline
    ],
)
def test_free_text_with_calls_held_to_their_schemas(text, ok, may_end):
    r = read(hermes_grammar(), text)
    assert (r is not None) == ok
    if ok:
        assert r.may_end == may_end and not r.complete


def test_any_trigger_works():
    """A trigger whose first character recurs in it (the old engine refused it): a call begins where its text first
    ends."""
    c = schema(None, "abca", "!", trigger=True)
    assert read(c, b"xxabxabca{}!done").may_end
    assert read(c, b"abcabca{") is None  # the call began after the first "abca": "bca{" is no object
    assert not read(c, b"ab abca{").may_end


@pytest.mark.parametrize(
    "text",
    [
        "",
        "see <too",
        "see <tool_call",
        "x<tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
    ],
)
def test_masks_in_and_around_calls_equal_a_token_by_token_check(text):
    """In free text and inside calls every token whose bytes read on is allowed; the end token is allowed exactly
    where the text is free."""
    tokens = [bytes([b]) for b in range(256)] + [
        b"<tool_call>",
        b"_call>",
        b"_call>\n{",
        b'>{"name": "get_',
        b"call>{",
        b"ol_call",
        b'"}}\n</tool_call>',
        b"></",
        b"\n</",
    ]
    end = len(tokens)
    check_masks_along(hermes_grammar(), tokens + [None], text.encode(), end + 1, end)


def test_tiny_model_replies_keep_every_triggered_object_valid(tiny_dirs):
    """A one-character trigger the model is pushed towards (a logit bias): the replies are free text with objects
    after each "@", every one valid against the schema and closed by the suffix before the text goes on."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    calls = 0
    for seed in range(4):
        params = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            json_schema=json.dumps(PARAMS),
            json_prefix="@",
            json_suffix="!",
            json_trigger=True,
            logit_bias=((ord("@"), 4.0),),
        )
        for o in llm.generate(["hello", "x y"], params):
            ids = o.token_ids[:-1] if o.token_ids[-1] == EOS_ID else o.token_ids
            text = bytes(ids).decode("utf-8", "replace")  # the tiny tokenizer: a token a byte
            assert read(constraint(params), bytes(ids)) is not None, text
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
    other = {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    }
    ask = dict(messages=[{"role": "user", "content": "Weather?"}])
    assert chat(http, **ask, tools=[strict(WEATHER), other]).status_code == 200
    s = fake.samplings[-1]
    assert s.json_trigger and s.json_prefix == "<tool_call>" and s.json_suffix == "\n</tool_call>"
    alts = json.loads(s.json_schema)["anyOf"]
    assert [a["properties"]["arguments"] for a in alts] == [WEATHER["function"]["parameters"], {"type": "object"}]
    assert chat(http, **ask, tools=[WEATHER]).status_code == 200 and not fake.samplings[-1].structured
    assert chat(http, **ask, tools=[strict(WEATHER)], tool_choice="required").status_code == 200
    assert not fake.samplings[-1].json_trigger and fake.samplings[-1].json_prefix == "<tool_call>\n"
    bounded = strict(
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}},
            },
        }
    )
    assert chat(http, **ask, tools=[bounded]).status_code == 200  # (llguidance enforces minimum)
    bad = strict(
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}},
            },
        }
    )
    r = chat(http, **ask, tools=[bad])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "uniqueItems" in r.json()["error"]["message"]
    (tmp_path / "llama").mkdir()
    http, fake, _ = serve(tiny_dirs, tmp_path / "llama", LLAMA3_TEMPLATE)
    fake.reply = "Sunny."
    assert chat(http, **ask, tools=[strict(WEATHER)]).status_code == 200 and not fake.samplings[-1].structured


B, E, C, S, CE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)


@pytest.mark.parametrize("code_block", [True, False])
def test_deepseek_calls_name_their_function_first_each_branch_holding_its_own_schema(code_block):
    """DeepSeek writes the name before the arguments: after the call's begin tag the text is one function's name
    (a branch), then that function's arguments: another's schema, or a name not offered, is refused."""
    shape = DeepSeekV3(code_block).triggered(FUNCTIONS)
    g = schema(shape.schema, shape.prefix, shape.suffix, trigger=True, branches=shape.branches)

    def call(name, args):
        return C + (f"function{S}{name}\n```json\n{args}\n```" if code_block else f"{name}{S}{args}") + CE

    text = "Let me look." + B + call("get_weather", '{"city": "Oslo"}') + call("get_time", '{"zone": 1}') + E + " Ok"
    state = read(g, text)
    assert state is not None and state.may_end
    assert read(g, B + call("get_weather", '{"zone": 1}')) is None  # get_time's arguments
    assert read(g, B + call("launch", "{}")) is None
    assert not read(g, B + call("get_weather", '{"city": "Oslo"}')[:-3]).may_end


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
    fmt = {
        "type": "structural_tag",
        "triggers": ["<function="],
        "structures": [
            {"begin": "<function=get_weather>", "schema": PARAMS, "end": "</function>"},
            {
                "begin": "<function=get_time>",
                "schema": {"type": "object", "properties": {"zone": {"type": "string"}}},
                "end": "</function>",
            },
        ],
    }
    ask = dict(messages=[{"role": "user", "content": "hi"}])
    assert chat(http, **ask, response_format=fmt).status_code == 200
    s = fake.samplings[-1]
    assert s.json_trigger and s.json_prefix == "<function=" and s.json_branches == ("get_weather>", "get_time>")
    g = constraint(s)
    text = 'Sure. <function=get_time>{"zone": "UTC"}</function> and <function=get_weather>{"city": "Oslo"}</function>'
    assert read(g, text).may_end
    assert read(g, b'<function=get_time>{"city": "Oslo"}') is not None  # get_time takes any properties
    assert read(g, b'<function=get_weather>{"zone": "UTC"}') is None
    assert chat(http, **ask, response_format=fmt, tools=[WEATHER]).status_code == 200
    for bad in (
        {**fmt, "triggers": ["<a", "<b"]},
        {**fmt, "structures": [{**fmt["structures"][0], "end": "!"}, fmt["structures"][1]]},
        {**fmt, "triggers": ["<function"], "structures": [{**fmt["structures"][0], "begin": "<fn=x>"}]},
        {"type": "structural_tag", "triggers": ["<f"]},
    ):
        r = chat(http, **ask, response_format=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
