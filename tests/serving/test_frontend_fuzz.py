"""Random request bodies against the HTTP frontend (a scripted test double in place of the cluster): whatever the
fields hold, the answer is a completion or an OpenAI error with a 4xx status, never a 500."""

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from test_tools import HERMES_TEMPLATE, WEATHER, serve

FIELDS = [
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "dualpath",
    "echo",
    "suffix",
    "presence_penalty",
    "logit_bias",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "use_beam_search",
    "prompt_logprobs",
    "guided_json",
    "structured_outputs",
    "guided_choice",
    "guided_regex",
]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
plausible = st.sampled_from(
    [
        [{"role": "user", "content": "hi"}],
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}],
            }
        ],
        "hello",
        [1, 2, 3],
        [WEATHER],
        "auto",
        "none",
        "required",
        4,
        0.5,
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {}}}}},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"json": {"type": "object"}},
        {"type": "function", "function": {"name": "get_weather"}},
    ]
)
# schema-shaped dicts, for the schema compiler
schemas = st.recursive(
    st.fixed_dictionaries(
        {}, optional={"type": st.sampled_from(["object", "string", "integer", ["null", "array"], "x"])}
    ),
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            "type": st.just("object"),
            "properties": st.dictionaries(st.text(max_size=3), inner, max_size=2),
            "required": st.lists(st.text(max_size=3), max_size=2),
            "items": inner,
            "anyOf": st.lists(inner, max_size=2),
            "additionalProperties": st.booleans() | inner,
            "enum": st.lists(scalars, max_size=2),
            "$ref": st.sampled_from(["#", "#/properties", "#/x"]),
            "minLength": st.integers(0, 3),
        },
    ),
    max_leaves=6,
)
texts = st.one_of(st.text(max_size=8), st.sampled_from(["bad \ud800", "\udfffx"]))  # lone surrogates too
said = st.one_of(texts, texts.map(lambda t: [{"role": "user", "content": t}]))  # a prompt or a chat turn
# a valid request of either kind with one or two fields replaced, so most bodies get past the first check
valid = st.sampled_from([{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hello"}])
bodies = st.builds(
    lambda base, changed: {**base, **changed},
    valid,
    st.dictionaries(st.sampled_from(FIELDS), st.one_of(said, values, plausible, schemas), max_size=2),
)


def test_random_bodies_get_a_reply_or_a_4xx(tiny_dirs, tmp_path):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = 'ok <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies, st.sampled_from(["chat/completions", "completions"]))
    def check(body, endpoint):
        r = http.post(
            f"/v1/{endpoint}", content=json.dumps({"model": "m", **body}), headers={"Content-Type": "application/json"}
        )
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"]

    check()


RESPONSE_FIELDS = [
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "include",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "reasoning",
    "truncation",
    "top_logprobs",
    "parallel_tool_calls",
    "metadata",
    "seed",
    "background",
]
TOOL = {"type": "function", **WEATHER["function"]}
response_values = st.sampled_from(
    [
        "hi",
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
        [
            {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "sunny"},
        ],
        [{"type": "function_call", "name": 3}],
        [{"role": "user", "content": [{"type": "input_image"}]}],
        [{"content": "no role"}],
        [],
        [TOOL],
        [TOOL, TOOL],
        [{"type": "web_search"}],
        {"type": "function", "name": "get_weather"},
        {"type": "function"},
        "required",
        {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        {"format": "text"},
        {"format": {"type": "json_object"}},
        ["message.output_text.logprobs"],
        {"effort": None},
        "disabled",
        8,
    ]
)


def test_random_responses_bodies_get_a_reply_or_a_4xx(tiny_dirs, tmp_path):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = 'ok <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.dictionaries(
            st.sampled_from(RESPONSE_FIELDS),
            st.one_of(values, response_values, response_values, st.dictionaries(st.just("format"), values)),
            max_size=2,
        )
    )
    def check(changed):
        r = http.post(
            "/v1/responses",
            content=json.dumps({"model": "m", "input": "hi", **changed}),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code in (200, 400), (changed, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"]

    check()
