"""OpenAI tool calling on the chat endpoint: the Hermes-markup splitter (pure), and the HTTP frontend with a
scripted test double in place of the cluster: tools and past calls reach the chat template, the model's calls come
back as ``tool_calls`` (streamed and not, through the real ``openai`` client), a call that does not parse stays
content, and what cannot be honoured (forced calls, JSON modes, templates without tools, non-text parts, broken
Unicode) is a 400 naming the field."""

import json
import shutil
from dataclasses import replace

import openai
import pytest

from dualpath.core.sessions import SessionHint
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar_check import completes, constraint, read
from dualpath.core.messages import TokenEvent
from dualpath.serving.openai_api import Frontend, FrontendConfig
from dualpath.serving.tools import DeepSeekV3, Hermes, Llama3Json, ToolCallSplitter, tool_markup
from dualpath.core.tokenizer import Tokenizer
from test_serving import validate

# A Hermes-style template written for these tests: tools listed in the system turn, past calls as <tool_call>
# blocks with their arguments as JSON objects, tool results as <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Llama-3.1-style template written for these tests: the JSON tool-calling instruction (whose wording names the
# markup), past calls as {"name", "parameters"} objects, tool results in "ipython" turns.
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|im_start|>user\nGiven the following functions, respond with a JSON for a function call. "
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "<|im_start|>{{ 'ipython' if message['role'] == 'tool' else message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}{\"name\": \"{{ call['function']['name'] }}\", "
    "\"parameters\": {{ call['function']['arguments'] | tojson }}}{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
NAMES = frozenset({"get_weather"})


class ScriptedClient:
    """Test double of ``ClusterClient``: every choice of a request is answered with the tokens of ``reply`` (a str,
    or one made per choice from its sampling parameters: choice i's with seed + i, as the engines seed it), the
    choices' tokens interleaved and each one's last finishing it (with the prompt's logprobs, made up, on each
    choice's first event when they are asked for); the prompts and sampling parameters it was sent are kept."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.reply, self.prompts, self.samplings = tokenizer, "", [], []
        self.request_ids, self.labels, self.aborts, self.agents, self.turns = [], [], [], [], []

    def start(self, prompt, sampling, request_id=None, mode="", label="", agent=None):
        self.agents.append(agent)
        self.prompts.append(list(prompt))
        self.request_ids.append(request_id)
        self.labels.append(label)
        self.samplings.append(sampling)
        replies = []
        for i in range(sampling.n):
            one = replace(sampling, n=1, seed=None if sampling.seed is None else sampling.seed + i)
            reply = self.reply(one) if callable(self.reply) else self.reply
            if isinstance(reply, Exception):
                raise reply
            if hasattr(reply, "events"):  # a handle of the test's own
                return reply
            replies.append(self.tokenizer.encode(reply, add_special_tokens=False))
        plps = (
            None
            if sampling.prompt_logprobs is None
            else [{"token_id": t, "logprob": -1.0, "top": [[t, -1.0]], "rank": 1} for t in list(prompt)[1:]]
        )
        handle = ScriptedHandle(replies, plps)
        handle.agent, handle.turns = agent, self.turns
        return handle

    def stats(self):
        return {"ready": True}

    def abort(self, label="", every=False):
        self.aborts.append((label, every))
        return 0

    def block_size(self):
        return 16


class ScriptedHandle:
    request_id = "scripted"
    agent, prefetched, turns = None, False, []

    def __init__(self, choices: list[list[int]], prompt_logprobs: list[dict] | None = None):
        self.choices, self.prompt_logprobs = choices, prompt_logprobs

    def events(self):
        out = []
        for step in range(max(map(len, self.choices))):
            for i, ids in enumerate(self.choices):
                if step < len(ids):
                    end = step == len(ids) - 1
                    out.append(
                        TokenEvent(
                            self.request_id,
                            ids[step],
                            finish_reason="stop" if end else "",
                            index=i,
                            final=False,
                            prompt_logprobs=None if step else self.prompt_logprobs,
                        )
                    )
        if out:
            out[-1] = replace(out[-1], final=True)
        yield from out

    def cancel(self):
        pass

    def end_turn(self, output_tokens, tool_wait=True, next_turn_in_s=None):
        self.turns.append((self.agent, list(output_tokens), tool_wait))


def serve(tiny_dirs, tmp_path, template, api_key=None, **config):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tiny_dirs["llama"] / "tokenizer.json", d)
    cfg = json.loads((tiny_dirs["llama"] / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    tok = Tokenizer(d)
    fake = ScriptedClient(tok)
    front = Frontend(
        FrontendConfig("m", str(d), "unused:0", max_model_len=4096, api_key=api_key, **config),
        client=fake,
        tokenizer=tok,
    )
    http = TestClient(front.app)
    http.front = front  # for checks of its admission count
    return http, fake, tok


@pytest.fixture
def hermes(tiny_dirs, tmp_path):
    return serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 64, **body})


def ask(**extra):
    return dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], **extra)


# --- the splitter -----------------------------------------------------------------------------------------------
def split_whole(text, names=NAMES, parallel=True, markup=Hermes()):
    s = ToolCallSplitter(markup, names, parallel)
    return s.feed(text) + s.finish(), s.calls


def test_the_markup_is_recognised_from_the_template():
    assert isinstance(tool_markup(HERMES_TEMPLATE), Hermes)
    assert isinstance(tool_markup(LLAMA3_TEMPLATE), Llama3Json)
    assert tool_markup("{{ messages }}") is None and tool_markup(None) is None


def test_plain_text_has_no_calls():
    assert split_whole("Sunny, 21 C.") == ("Sunny, 21 C.", [])


def test_calls_are_parsed_with_text_before_them_kept():
    content, calls = split_whole("Checking." + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["function"]["name"] == "get_weather" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_parallel_false_keeps_the_first_call():
    _, calls = split_whole(CALL + CALL.replace("Paris", "Oslo"), parallel=False)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not one of the request's tools
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut off (max_tokens)
    ],
)
def test_text_that_is_not_a_valid_call_stays_content(bad):
    assert split_whole("ok " + bad) == ("ok " + bad, [])


@pytest.mark.parametrize(
    "markup, text, secret",
    [
        (Hermes(), "Let me look <tool_ that up. " + CALL + " done", "<tool_call>"),
        (Llama3Json(), " <|python_tag|>" + '{"name": "get_weather", "parameters": {"city": "Paris"}}', "{"),
        (Llama3Json(), " <|python_tug|> {}", "never held: not a call"),
    ],
)
def test_streamed_in_any_pieces_the_result_is_the_same(markup, text, secret):
    whole = split_whole(text, markup=markup)
    for cut in range(len(text) + 1):
        s = ToolCallSplitter(markup, NAMES)
        shown = [s.feed(text[:cut]), s.feed(text[cut:])]
        assert secret not in shown[0] + shown[1]  # nothing from where calls begin is shown before the end
        shown.append(s.finish())
        assert "".join(shown) == whole[0] and [c["function"] for c in s.calls] == [c["function"] for c in whole[1]]


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "text, calls",
    [
        (LLAMA_CALL, [{"city": "Paris"}]),
        (" \n" + LLAMA_CALL, [{"city": "Paris"}]),
        (
            "<|python_tag|>" + LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Oslo"),
            [{"city": "Paris"}, {"city": "Oslo"}],
        ),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [{"city": "Paris"}]),
    ],
)
def test_llama3_json_calls(text, calls):
    content, got = split_whole(text, markup=Llama3Json())
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in got] == calls


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",  # prose
        "Sure: " + LLAMA_CALL,  # a call not at the start is text
        '{"name": "launch_rockets", "parameters": {}}',  # not one of the request's tools
        '{"weather": "sunny"}',  # JSON the user may have asked for
        LLAMA_CALL + " and more",  # calls then prose
    ],
)
def test_llama3_json_text_that_is_not_calls_stays_content(text):
    assert split_whole(text, markup=Llama3Json()) == (text, [])


def test_llama3_json_prose_streams_at_once_and_a_call_is_held():
    s = ToolCallSplitter(Llama3Json(), NAMES)
    assert s.feed("  ") == "" and s.feed("It") == "  It" and s.feed(" is") == " is"
    s = ToolCallSplitter(Llama3Json(), NAMES)
    assert s.feed("<|pyth") == "" and s.feed("on_tag|>" + LLAMA_CALL[:10]) == "" and s.feed(LLAMA_CALL[10:]) == ""
    assert s.finish() == "" and len(s.calls) == 1


def test_a_partial_tag_is_held_back_then_shown_if_no_call_follows():
    s = ToolCallSplitter(Hermes(), NAMES)
    assert s.feed("see <tool") == "see "
    assert s.feed("box>") == "<toolbox>"
    assert s.finish() == "" and s.calls == []


# --- through the HTTP frontend ----------------------------------------------------------------------------------
def test_a_call_comes_back_as_tool_calls(hermes):
    http, fake, _ = hermes
    fake.reply = "Let me check." + CALL
    r = chat(http, **ask())
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_the_openai_client_reads_calls_streamed_and_not(hermes):
    http, fake, _ = hermes
    fake.reply = CALL
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    msg = client.chat.completions.create(model="m", **ask()).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content is None
    assert msg.message.tool_calls[0].function.name == "get_weather"
    chunks = list(client.chat.completions.create(model="m", stream=True, **ask()))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls if tc.id] == [(0, "get_weather")]  # named once, first
    assert calls[0].id.startswith("call_") and all(tc.index == 0 for tc in calls)
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
    assert len(calls) > 2  # the arguments stream as the model writes them
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_streamed_chunks_conform_and_text_before_the_call_streams(hermes):
    http, fake, _ = hermes
    fake.reply = "One moment." + CALL
    with http.stream("POST", "/v1/chat/completions", json={"model": "m", "stream": True, **ask()}) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    chunks = [json.loads(x[6:]) for x in lines]
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "One moment."
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_sessions_turn_that_calls_a_tool_tells_the_scheduler_it_waits(hermes, stream):
    http, fake, tok = hermes
    fake.reply = CALL
    r = http.post(
        "/v1/chat/completions",
        json={"model": "m", "max_tokens": 64, "stream": stream, **ask(dualpath={"session": {"ttl_s": 60}})},
        headers={"X-Session-Id": "agent-7"},
    )
    assert r.status_code == 200
    assert fake.agents == [SessionHint("agent-7", ttl_s=60.0)]
    assert fake.turns == [(SessionHint("agent-7", ttl_s=60.0), tok.encode(CALL, add_special_tokens=False), True)]
    fake.reply = "Sunny."
    chat(http, **ask(), stream=stream)  # no session: nothing to tell
    assert len(fake.turns) == 1
    http.post("/v1/chat/completions", json={"model": "m", **ask()}, headers={"X-Session-Id": "agent-7"})
    assert fake.turns[-1][2] is False  # a reply without calls: the session does not wait for a tool


def test_a_session_hint_out_of_bounds_is_a_400_naming_it(hermes):
    http, fake, _ = hermes
    r = chat(http, **ask(dualpath={"session": {"id": "a", "next_turn_in_s": -3}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "dualpath.session.next_turn_in_s"
    r = http.post("/v1/chat/completions", json={"model": "m", **ask()}, headers={"X-Session-Id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Id.id"
    assert not fake.prompts  # nothing was submitted


def test_history_with_calls_and_results_reaches_the_template(hermes):
    http, fake, tok = hermes
    fake.reply = "Sunny."
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    r = chat(http, messages=history, tools=[WEATHER])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Sunny.", "refusal": None}
    prompt = tok.decode(fake.prompts[-1], skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and '"description": "Weather of a city"' in prompt  # the tool
    assert CALL in prompt  # the past call, arguments as an object (not a quoted string)
    assert "<tool_response>21 C, sunny</tool_response>" in prompt


def test_tool_choice_none_withholds_the_tools_and_parses_nothing(hermes):
    http, fake, tok = hermes
    fake.reply = CALL
    r = chat(http, **ask(tool_choice="none"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
    assert "<tools>" not in tok.decode(fake.prompts[-1], skip_special_tokens=False)


def test_a_call_that_does_not_parse_is_returned_as_text(hermes):
    http, fake, _ = hermes
    fake.reply = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    choice = chat(http, **ask()).json()["choices"][0]
    assert choice["message"]["content"] == fake.reply and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}


@pytest.mark.parametrize(
    "choice, names",
    [("required", ["get_weather", "get_time"]), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])],
)
def test_a_forced_call_is_constrained_to_the_markup_and_the_tools_schemas(hermes, choice, names):
    """tool_choice "required" or named: the engines get the call's schema (the chosen functions' names and
    parameters) with the template's markup around it; the reply comes back as a tool call."""
    http, fake, _ = hermes
    fake.reply = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    r = chat(http, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK], tool_choice=choice)
    assert r.status_code == 200, r.text
    s = fake.samplings[-1]
    assert (s.json_prefix, s.json_suffix) == ("<tool_call>\n", "\n</tool_call>")
    schema = json.loads(s.json_schema)
    alts = schema.get("anyOf", [schema])
    assert [a["properties"]["name"]["const"] for a in alts] == names
    assert alts[-1]["properties"]["arguments"] == CLOCK["function"]["parameters"]
    choice0 = r.json()["choices"][0]
    assert choice0["finish_reason"] == "tool_calls"
    assert json.loads(choice0["message"]["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            ask(tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "one of the request's tools",
        ),
        (
            dict(
                messages=[{"role": "user", "content": "x"}],
                tool_choice="required",
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ],
            ),
            "tools",
            'Unimplemented keys: ["uniqueItems"]',
        ),
        (dict(messages=[{"role": "user", "content": "x"}], tool_choice="auto"), "tool_choice", "needs tools"),
        (
            dict(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema"}),
            "response_format",
            "needs a json_schema",
        ),
        (
            dict(
                messages=[{"role": "user", "content": "x"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}},
                    },
                },
            ),
            "response_format",
            "look-around",
        ),
        (ask(response_format={"type": "json_object"}), "response_format", "not supported"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages",
            "'image_url' are not supported",
        ),
        (dict(messages=[{"role": "user", "content": "bad \ud800 char"}]), "messages", "lone surrogate"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(hermes, extra, param, words):
    http, fake, _ = hermes
    body = json.dumps({"model": "m", **extra})  # json.dumps escapes the lone surrogate, as a client would
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert not fake.prompts  # nothing was submitted


def test_deep_nesting_is_a_400(hermes):
    http, _, _ = hermes
    r = http.post("/v1/chat/completions", content="[" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "deep" in r.json()["error"]["message"] or "not valid JSON" in r.json()["error"]["message"]


def test_tools_for_a_template_without_them_is_a_400(tiny_dirs, tmp_path):
    from dualpath.checkpoints.chatml import CHATML_TEMPLATE

    http, fake, _ = serve(tiny_dirs, tmp_path, CHATML_TEMPLATE)
    r = chat(http, **ask())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    fake.reply = "fine"
    assert chat(http, **ask(tool_choice="none")).status_code == 200  # withheld tools need no markup


def test_offline_chat_passes_tools_to_the_template(tiny_dirs, tmp_path):
    from dualpath import LLM, SamplingParams

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["llama"], ckpt)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": HERMES_TEMPLATE}))
    llm = LLM(str(ckpt), block_size=16)
    msgs = ask()["messages"]
    (with_tools,) = llm.chat(msgs, SamplingParams(max_tokens=1), tools=[WEATHER])
    (without,) = llm.chat(msgs, SamplingParams(max_tokens=1))
    assert '"name": "get_weather"' in llm.tokenizer.decode(with_tools.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" not in llm.tokenizer.decode(without.prompt_token_ids, skip_special_tokens=False)
    (other,) = llm.chat(msgs, SamplingParams(max_tokens=1), chat_template="Q: {{ messages[-1]['content'] }}\nA:")
    assert llm.tokenizer.decode(other.prompt_token_ids) == "Q: Weather in Paris?\nA:"


def test_llama3_template_calls_through_the_frontend(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, LLAMA3_TEMPLATE)
    fake.reply = LLAMA_CALL
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    choice = client.chat.completions.create(model="m", **ask()).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    history = [
        *ask()["messages"],
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "21 C"},
    ]
    fake.reply = "It is 21 C."
    again = client.chat.completions.create(model="m", messages=history, tools=[WEATHER]).choices[0]
    assert again.message.content == "It is 21 C." and again.finish_reason == "stop"
    prompt = tok.decode(fake.prompts[-1], skip_special_tokens=False)
    assert LLAMA_CALL in prompt and "ipython\n21 C" in prompt  # the call as the model wrote it, and its result


# --- DeepSeek-V3 (the paper's model) and V3.1 -------------------------------------------------------------------
B, E, C, S, CE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)
# DeepSeek-V3-style templates written for these tests: tools in the system turn, past calls in the model's markup
DEEPSEEK_TEMPLATE = (
    "{%- if tools %}<｜System｜>Tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}"
    "{%- for message in messages %}{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{% else %}<｜Assistant｜>{{ message['content'] or '' }}{% if message.get('tool_calls') %}"
    + B
    + "{% for call in message['tool_calls'] %}"
    + C
    + "function"
    + S
    + "{{ call['function']['name'] }}\n```json\n"
    "{{ call['function']['arguments'] | tojson }}\n```" + CE + "{% endfor %}" + E + "{% endif %}{% endif %}"
    "{% endfor %}{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
DEEPSEEK31_TEMPLATE = DEEPSEEK_TEMPLATE.replace(
    C + "function" + S + "{{ call['function']['name'] }}\n```json\n", C + "{{ call['function']['name'] }}" + S
).replace("\n```" + CE, CE)
V3_CALL = B + C + "function" + S + 'get_weather\n```json\n{"city": "Paris"}\n```' + CE + E
V31_CALL = B + C + "get_weather" + S + '{"city": "Paris"}' + CE + E


@pytest.mark.parametrize(
    "text, calls, content",
    [
        (V3_CALL, [{"city": "Paris"}], ""),
        ("Let me check. " + V3_CALL, [{"city": "Paris"}], "Let me check. "),
        (V31_CALL, [{"city": "Paris"}], ""),
        (
            B
            + C
            + "function"
            + S
            + 'get_weather\n```json\n{"city": "Paris"}\n```'
            + CE
            + "\n"
            + C
            + "function"
            + S
            + 'get_weather\n```json\n{"city": "Oslo"}\n```'
            + CE
            + E,
            [{"city": "Paris"}, {"city": "Oslo"}],
            "",
        ),
    ],
)
def test_deepseek_calls(text, calls, content):
    got_content, got = split_whole(text, markup=DeepSeekV3())
    assert got_content == content and [json.loads(c["function"]["arguments"]) for c in got] == calls
    assert all(c["function"]["name"] == "get_weather" for c in got)


@pytest.mark.parametrize(
    "bad",
    [
        B + C + "function" + S + "launch_rockets\n```json\n{}\n```" + CE + E,  # not one of the request's tools
        B + C + "function" + S + 'get_weather\n```json\n{"city": \n```' + CE + E,  # not JSON
        B + C + "get_weather" + S + "[1]" + CE + E,  # arguments not an object
        B + C + "function" + S + 'get_weather\n```json\n{"city": "Pa',  # cut off
    ],
)
def test_deepseek_text_that_is_not_a_valid_call_stays_content(bad):
    assert split_whole("ok " + bad, markup=DeepSeekV3()) == ("ok " + bad, [])


def test_deepseek_streamed_in_any_pieces_the_result_is_the_same():
    text = "Looking <｜tool▁ it up. " + V3_CALL
    whole = split_whole(text, markup=DeepSeekV3())
    for cut in range(len(text) + 1):
        s = ToolCallSplitter(DeepSeekV3(), NAMES)
        shown = [s.feed(text[:cut]), s.feed(text[cut:])]
        assert B not in shown[0] + shown[1]
        shown.append(s.finish())
        assert "".join(shown) == whole[0] and len(s.calls) == 1


@pytest.mark.parametrize(
    "template, reply, prefix, suffix",
    [
        (DEEPSEEK_TEMPLATE, V3_CALL, B + C + "function" + S + "get_time\n```json\n", "\n```" + CE + E),
        (DEEPSEEK31_TEMPLATE, V31_CALL, B + C + "get_time" + S, CE + E),
    ],
)
def test_deepseek_templates_through_the_frontend(tiny_dirs, tmp_path, template, reply, prefix, suffix):
    """The markup is recognised from each template's form; calls come back as tool_calls and go back into the
    template; a named (forced) call's prefix names the function, its schema is the parameters; "required" with
    several tools offers a branch per tool (its name, then its parameters' object)."""
    http, fake, tok = serve(tiny_dirs, tmp_path, template)
    assert isinstance(tool_markup(template), DeepSeekV3)
    fake.reply = reply
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    choice = client.chat.completions.create(model="m", **ask()).choices[0]
    assert choice.finish_reason == "tool_calls" and json.loads(choice.message.tool_calls[0].function.arguments) == {
        "city": "Paris"
    }
    history = [
        *ask()["messages"],
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "21 C"},
    ]
    fake.reply = "It is 21 C."
    client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert S in tok.decode(fake.prompts[-1], skip_special_tokens=False)
    fake.reply = prefix + '{"zone": "UTC"}' + suffix
    r = chat(
        http,
        messages=[{"role": "user", "content": "time?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    s = fake.samplings[-1]
    assert (s.json_prefix + "".join(s.json_branches), s.json_suffix) == (prefix, suffix)
    assert json.loads(s.json_schema) == {"anyOf": [CLOCK["function"]["parameters"]]}
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    r = chat(http, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK], tool_choice="required")
    assert r.status_code == 200, r.text
    s = fake.samplings[-1]
    g = constraint(s)
    assert len(s.json_branches) == 2 and completes(g, prefix + '{"zone": "UTC"}' + suffix)
    weather = prefix.replace("get_time", "get_weather") + '{"city": "Oslo"}' + suffix
    assert completes(g, weather)
    assert read(g, prefix.replace("get_time", "get_weather") + '{"zone": "UTC"}') is None
    assert read(g, prefix.replace("get_time", "launch")) is None


# --- calls streamed as they are written ---------------------------------------------------------------------
def stream_split(text, markup=Hermes(), names=NAMES, parallel=True):
    """Feed ``text`` a character at a time: the content, the calls joined from their deltas (each with the number
    of characters fed when each of its deltas came; ``None`` for those that came with ``finish``), the splitter."""
    s, content, calls = ToolCallSplitter(markup, names, parallel), [], []
    for fed, piece in [*((i + 1, c) for i, c in enumerate(text)), (None, None)]:
        content.append(s.feed(piece) if piece is not None else s.finish())
        for d in s.call_deltas():
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": "", "at": []})
            call = calls[d["index"]]
            call["arguments"] += d["function"]["arguments"]
            call["at"].append(fed)
    return "".join(content), calls, s


PRETTY = '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Paris \\"}{\\" \\u00e9",\n  "days": [1, {"a": []}]\n}}\n</tool_call>'
STREAMED = [
    (Hermes(), "Checking. " + CALL + " and " + CALL.replace("Paris", "Oslo")),
    (Hermes(), PRETTY),  # braces and escaped quotes inside strings, nesting, blanks
    (Llama3Json(), "<|python_tag|>" + LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Oslo")),
    (
        DeepSeekV3(),
        "Let me check. "
        + V3_CALL.replace(CE, CE + "\n" + C + "function" + S + 'get_weather\n```json\n{"city": "Oslo"}\n```' + CE),
    ),
    (DeepSeekV3(code_block=False), V31_CALL),
]


@pytest.mark.parametrize("markup, text", STREAMED)
def test_calls_stream_as_they_are_written_and_join_to_the_whole_reply(markup, text):
    """Streamed a character at a time, the content and the calls joined from their deltas equal the reply parsed
    whole (the arguments are the model's own JSON text); each call is named once its name is written and its
    arguments arrive in pieces, all of them before the text ends (an object's arguments)."""
    content, calls, s = stream_split(text, markup)
    whole_content, whole_calls = split_whole(text, markup=markup)
    assert content == whole_content and s.whole
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
    ]
    assert [c["id"] for c in calls] == [c["id"] for c in s.calls]
    for c in calls:
        assert isinstance(json.loads(c["arguments"]), dict) and c["arguments"] in text
        assert None not in c["at"] and len(c["at"]) >= 3  # before the end, in pieces
        assert c["at"][0] < text.index(c["arguments"]) + len(c["arguments"])  # named before its arguments end


def test_a_call_streams_in_order_and_only_once_named():
    text = CALL + '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    _, calls, _ = stream_split(text)
    second = text.index("Oslo")
    assert calls[1]["at"][0] > text.index('"name"', second)  # its arguments waited for its name
    _, calls, s = stream_split(text, parallel=False)
    assert len(calls) == 1 and len(s.calls) == 1 and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_arguments_written_as_a_json_string_come_decoded_at_the_end():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    content, calls, s = stream_split(text)
    assert content == "" and calls[0]["arguments"] == '{"city": "Paris"}' and calls[0]["at"][-1] is None
    assert split_whole(text)[1][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize(
    "text, args, rest, whole",
    [
        # a valid call streamed, then one to a tool the request does not have: that one is text
        (
            CALL + ' <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
            '{"city": "Paris"}',
            ' <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
            True,
        ),
        # cut inside the arguments (max_tokens): the call as written, not complete
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa', "", False),
        # arguments that do not parse
        ('<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call> ok', '{"city": }', " ok", False),
    ],
)
def test_a_streamed_call_stays_when_the_reply_then_breaks(text, args, rest, whole):
    """A call once streamed cannot be taken back: it is delivered as written and the text after it is content;
    ``whole`` says whether the calls delivered are complete. Unstreamed, the same reply is all text."""
    content, calls, s = stream_split("Hm. " + text)
    assert content == "Hm. " + rest and [c["arguments"] for c in calls] == [args] and s.whole == whole
    assert [c["function"]["arguments"] for c in s.calls] == [args]
    assert split_whole("Hm. " + text) == ("Hm. " + text, [])


def test_a_long_call_is_not_rescanned_for_every_piece():
    """While a call's arguments are open only the new text is read (rescanning the call from its start for every
    piece took 23 s for this one, quadratic in its length): a 100,000-character argument fed 4 characters at a
    time (25,000 pieces) makes the markup read the whole text a handful of times."""

    class Counted(Hermes):
        reads = 0

        def drafts(self, held):
            Counted.reads += 1
            return super().drafts(held)

    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "' + 'ab\\"{}' * 20_000 + '"}}</tool_call>'
    s, n = ToolCallSplitter(Counted(), NAMES), 0
    for i in range(0, len(text), 4):
        s.feed(text[i : i + 4])
        n += sum(len(d["function"]["arguments"]) for d in s.call_deltas())
    assert s.finish() == "" and s.whole
    n += sum(len(d["function"]["arguments"]) for d in s.call_deltas())
    args = text[text.index('{"city"') : -len("}</tool_call>")]
    assert s.calls[0]["function"]["arguments"] == args and n == len(args)
    assert Counted.reads < 30


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab "\\{}[]:,\n\u00e9\U0001f600', max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\{}', max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    args=st.dictionaries(st.text(alphabet='xy"\\}', max_size=3), JSON_VALUES, max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(1, 7), min_size=1, max_size=20),
    markup=st.sampled_from([Hermes(), Llama3Json(), DeepSeekV3(), DeepSeekV3(code_block=False)]),
)
def test_any_arguments_in_any_pieces_stream_to_the_whole_call(args, indent, cuts, markup):
    """Arguments with quotes, backslashes, brackets and blanks inside strings, nested, pretty-printed or not, fed
    in random pieces: the streamed calls join to the calls parsed whole, the arguments exactly the model's text."""
    body = json.dumps(args, indent=indent, ensure_ascii=False)
    text = {
        Hermes: f'<tool_call>\n{{"name": "get_weather", "arguments": {body}}}\n</tool_call>',
        Llama3Json: f'{{"name": "get_weather", "parameters": {body}}}',
    }.get(type(markup)) or (
        B + C + "function" + S + f"get_weather\n```json\n{body}\n```" + CE + E
        if markup.code_block
        else B + C + "get_weather" + S + body + CE + E
    )
    s, pos, joined = ToolCallSplitter(markup, NAMES), 0, ""
    for cut in cuts * (len(text) // sum(cuts) + 1):
        s.feed(text[pos : pos + cut])
        pos += cut
        joined += "".join(d["function"]["arguments"] for d in s.call_deltas())
    assert s.finish() == ""
    joined += "".join(d["function"]["arguments"] for d in s.call_deltas())
    assert joined == body == s.calls[0]["function"]["arguments"] and split_whole(text, markup=markup)[1]


class CutHandle(ScriptedHandle):
    """Test double of a reply cut by max_tokens."""

    def events(self):
        for ev in super().events():
            yield replace(ev, finish_reason="length") if ev.finish_reason else ev


def test_a_call_cut_by_max_tokens_streams_as_written_and_finishes_with_length(hermes):
    """Streamed, a call begun before the cut is delivered as written (OpenAI's behaviour) and the finish reason
    stays "length"; not streamed, the same reply is text (nothing was promised as a call)."""
    http, fake, tok = hermes
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    fake.reply = lambda _: CutHandle([tok.encode(cut, add_special_tokens=False)])
    with http.stream("POST", "/v1/chat/completions", json={"model": "m", "stream": True, **ask()}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Pa'
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and not any(d.get("content") for d in deltas)
    choice = chat(http, **ask()).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == cut
    assert not choice["message"].get("tool_calls")


# --- --chat-template and --tool-call-parser ---------------------------------------------------------------------
def test_a_chat_template_given_to_the_server_brings_tool_calling_to_a_model_without_one(tiny_dirs, tmp_path):
    """The checkpoint's template renders no tools (a 400); served with a Hermes-style template (vLLM's
    --chat-template) the tools reach the prompt and the calls come back."""
    http, fake, tok = serve(tiny_dirs, tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat(http, **ask()).status_code == 400
    (tmp_path / "other").mkdir()
    http, fake, tok = serve(
        tiny_dirs,
        tmp_path / "other",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        chat_template=HERMES_TEMPLATE,
    )
    fake.reply = CALL
    choice = chat(http, **ask()).json()["choices"][0]
    assert (
        choice["finish_reason"] == "tool_calls"
        and choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    assert "<tools>" in tok.decode(fake.prompts[-1], skip_special_tokens=False)


@pytest.mark.parametrize(
    "parser, reply, calls",
    [
        ("none", CALL, None),  # tools refused: no markup to parse
        ("llama3_json", LLAMA_CALL, [{"city": "Paris"}]),  # named, whatever the template says
        ("auto", CALL, [{"city": "Paris"}]),
    ],
)
def test_the_tool_call_parser_can_be_named(tiny_dirs, tmp_path, parser, reply, calls):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, tool_call_parser=parser)
    fake.reply = reply
    r = chat(http, **ask())
    if calls is None:
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        return
    got = r.json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in got] == calls


def test_chat_templates_load_from_a_file_or_as_text_and_bad_ones_fail_at_start(tiny_dirs, tmp_path):
    from dualpath.cli import build_parser
    from dualpath.core.errors import CheckpointError
    from dualpath.serving.serve import frontend_options
    from dualpath.core.tokenizer import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text(HERMES_TEMPLATE)
    args = build_parser().parse_args(
        [
            "serve",
            "--chat-template",
            str(f),
            "--tool-call-parser",
            "hermes",
            "--migration-limit",
            "0",
            "--trust-request-chat-template",
        ]
    )
    assert frontend_options(args) == dict(
        reasoning_parser="auto",
        tool_call_parser="hermes",
        chat_template=HERMES_TEMPLATE,
        migration_limit=0,
        trust_request_chat_template=True,
        generation_config="auto",
        lora_modules=(),
    )
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(CheckpointError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(CheckpointError, match="chat template"):
        Tokenizer(tiny_dirs["llama"]).with_chat_template("{% for m in messages %}")
    llm_tok = Tokenizer(tiny_dirs["llama"]).with_chat_template("<{{ messages[0]['content'] }}>")
    assert llm_tok.render_chat([{"role": "user", "content": "hi"}]) == "<hi>"


@pytest.mark.parametrize("n_tools", [1, 2])
def test_tools_with_nested_pydantic_parameters_can_be_forced(hermes, n_tools):
    """pydantic writes a nested model as a ``$ref`` into its ``$defs`` (what agent frameworks send as a tool's
    parameters): placed inside the call object's schema, the references are rebased and the call validates."""
    import jsonschema
    import pydantic

    class Place(pydantic.BaseModel):
        city: str
        near: "Place | None" = None

    class Trip(pydantic.BaseModel):
        start: Place
        stops: list[Place]

    http, fake, _ = hermes
    params = Trip.model_json_schema()
    assert "$defs" in params
    tools = [{"type": "function", "function": {"name": f"plan{i}", "parameters": params}} for i in range(n_tools)]
    fake.reply = '<tool_call>\n{"name": "plan0", "arguments": {"start": {"city": "Oslo"}, "stops": []}}\n</tool_call>'
    r = chat(http, messages=[{"role": "user", "content": "plan"}], tools=tools, tool_choice="required")
    assert r.status_code == 200, r.text
    grammar = constraint(fake.samplings[-1])
    trip = {"start": {"city": "Oslo", "near": {"city": "Bergen"}}, "stops": [{"city": "Rome", "near": None}]}
    jsonschema.validate(trip, params)
    prefix, suffix = fake.samplings[-1].json_prefix, fake.samplings[-1].json_suffix
    assert completes(grammar, prefix + json.dumps({"name": "plan0", "arguments": trip}) + suffix)
    assert read(grammar, prefix + json.dumps({"name": "plan0", "arguments": {"start": {"town": "x"}}})) is None


# --- Qwen3-Coder's XML calls ------------------------------------------------------------------------------------
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "To call a function reply with:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n<function={{ call['function']['name'] }}>\n"
    "{% for k, v in call['function']['arguments'].items() %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EDIT = {
    "type": "function",
    "function": {
        "name": "edit_file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "dry_run": {"type": "boolean"},
                "ranges": {"type": "array"},
                "zip": {"type": "string"},
                "ratio": {"type": ["number", "null"]},
            },
        },
    },
}
QWEN_CALL = (
    "<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=line>\n42\n"
    "</parameter>\n<parameter=dry_run>\nfalse\n</parameter>\n<parameter=ranges>\n[[1, 2]]\n</parameter>\n"
    "<parameter=zip>\n01234\n</parameter>\n<parameter=ratio>\nnull\n</parameter>\n<parameter=body>\n"
    "def f():\n    return 1\n</parameter>\n</function>\n</tool_call>"
)
QWEN_ARGS = {
    "path": "src/a.py",
    "line": 42,
    "dry_run": False,
    "ranges": [[1, 2]],
    "zip": "01234",
    "ratio": None,
    "body": "def f():\n    return 1",
}


def test_qwen3_coder_calls_are_typed_by_the_tools_parameters():
    from dualpath.serving.tools import Qwen3Xml

    markup = Qwen3Xml().for_tools({"edit_file": EDIT["function"]["parameters"]})
    names = frozenset({"edit_file"})
    content, calls = split_whole("Editing. " + QWEN_CALL + "\n" + QWEN_CALL, names, markup=markup)
    assert content == "Editing. " and [json.loads(c["function"]["arguments"]) for c in calls] == [QWEN_ARGS] * 2
    assert isinstance(tool_markup(QWEN3_CODER_TEMPLATE), Qwen3Xml)
    streamed, got, s = stream_split("Editing. " + QWEN_CALL, markup, names)
    assert streamed == "Editing. " and [json.loads(c["arguments"]) for c in got] == [QWEN_ARGS]
    assert got[0]["at"][0] < len("Editing. <tool_call>\n<function=edit_file>") + 5  # named as soon as written
    for bad in (QWEN_CALL.replace("edit_file", "rm_rf"), QWEN_CALL.replace("</function>", "</func>"), QWEN_CALL[:-30]):
        assert split_whole(bad, names, markup=markup) == (bad, [])


def test_qwen3_coder_template_through_the_frontend(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, QWEN3_CODER_TEMPLATE)
    fake.reply = QWEN_CALL
    ask_edit = dict(messages=[{"role": "user", "content": "fix it"}], tools=[EDIT])
    choice = chat(http, **ask_edit).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == QWEN_ARGS
    history = [*ask_edit["messages"], choice["message"], {"role": "tool", "tool_call_id": "x", "content": "ok"}]
    fake.reply = "Done."
    assert chat(http, messages=history, tools=[EDIT]).status_code == 200
    assert "<parameter=line>\n42\n</parameter>" in tok.decode(fake.prompts[-1], skip_special_tokens=False)
    r = chat(http, **ask_edit, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
