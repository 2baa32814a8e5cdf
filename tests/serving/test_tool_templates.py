"""The tool-capable chat templates shipped in ``dualpath/templates`` (``--chat-template tool_hermes``, ...): each
renders the tools, a past call and its result; its markup is recognised by the parser of its family; a call rendered
in the history reads back as the same call; and, served with the tiny model behind the real frontend (the
single-process reference standing in for the cluster), a forced call ("required" or named) comes back as a
parsable tool call and the conversation goes on with the tool's result."""

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from dualpath import LLM
from dualpath.core.errors import CheckpointError
from dualpath.core.messages import TokenEvent
from dualpath.serving.openai_api import Frontend, FrontendConfig
from dualpath.serving.tools import TOOL_PARSERS, ToolCallSplitter, tool_markup
from dualpath.core.tokenizer import Tokenizer, load_chat_template, shipped_templates

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY},
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Time in a city", "parameters": CITY}}
CALLED = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
]
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}
# A random model may write JSON's optional blanks until max_tokens: kept from them, its call ends (the markup's own
# newlines are forced, so they are written all the same). The tiny tokenizer's token ids are byte values.
NO_BLANKS = {str(b): -100 for b in b" \t\n\r"}
# each shipped template: the parser of its markup (--tool-call-parser's name) and its end of an assistant turn
FAMILIES = {
    "tool_hermes": ("hermes", "<|im_end|>\n"),
    "tool_qwen3_coder": ("qwen3_coder", "<|im_end|>\n"),
    "tool_llama3_json": ("llama3_json", "<|eot_id|>"),
    "tool_deepseek_v3": ("deepseek_v3", "<｜end▁of▁sentence｜>"),
    "tool_deepseek_v31": ("deepseek_v31", "<｜end▁of▁sentence｜>"),
}


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return Tokenizer(tiny_dirs["llama"])


def test_every_parser_has_a_shipped_template():
    assert set(shipped_templates()) == set(FAMILIES)
    assert {parser for parser, _ in FAMILIES.values()} == set(TOOL_PARSERS)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_template_renders_tools_a_call_and_its_result_in_its_parsers_markup(tok, name):
    parser, end = FAMILIES[name]
    t = tok.with_chat_template(load_chat_template(name))
    markup = tool_markup(t.chat_template)  # recognised from the template, as the frontend does with "auto"
    assert type(markup) is type(TOOL_PARSERS[parser]()) and vars(markup) == vars(TOOL_PARSERS[parser]())
    whole = t.render_chat([*CALLED, RESULT], tools=[WEATHER])
    assert "get_weather" in whole and "Weather of a city" in whole and "21 C, sunny" in whole
    assert whole.index("Weather in Paris?") < whole.index("21 C, sunny")
    # the past call, as the template writes it after the generation prompt, reads back as the same call
    prompt = t.render_chat(CALLED[:1], tools=[WEATHER])
    history = t.render_chat(CALLED, tools=[WEATHER], add_generation_prompt=False)
    assert history.startswith(prompt), (prompt, history)
    reply = history[len(prompt) :].removesuffix(end)
    splitter = ToolCallSplitter(markup.for_tools({"get_weather": CITY}), {"get_weather"}, True)
    content = splitter.feed(reply) + splitter.finish()
    assert content == "" and [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in splitter.calls
    ] == [("get_weather", {"city": "Paris"})], reply
    # no tools: no tool section; a conversation without tools still renders
    assert "get_weather" not in t.render_chat(CALLED[:1])


def test_chat_template_names_a_shipped_template_a_file_or_the_text(tmp_path):
    hermes = load_chat_template("tool_hermes")
    assert "<tool_call>" in hermes and hermes == shipped_templates()["tool_hermes"].read_text()
    own = tmp_path / "tool_hermes"  # a file of the same name wins (vLLM's rule: a path first)
    own.write_text("{{ 'mine' }}")
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert load_chat_template("tool_hermes") == "{{ 'mine' }}"
    finally:
        os.chdir(cwd)
    with pytest.raises(CheckpointError, match="tool_hermes"):  # an unknown name lists the shipped ones
        load_chat_template("tool_nope")


class ModelClient:
    """Test double of ``ClusterClient``: the cluster as the single-process reference answers, each request
    generated at once with its sampling parameters (a forced call's constraint included), its tokens then streamed
    as the engines send them."""

    def __init__(self, llm: LLM):
        self.llm, self.prompts = llm, []

    def start(self, prompt, sampling, request_id=None, mode="", label="", agent=None):
        self.prompts.append(list(prompt))
        return ModelHandle(self.llm.generate([list(prompt)], sampling))

    def stats(self):
        return {"ready": True}

    def abort(self, label="", every=False):
        return 0

    def block_size(self):
        return 16


class ModelHandle:
    request_id = "model"

    def __init__(self, outs):
        self.outs = outs

    def events(self):
        for i, o in enumerate(self.outs):
            for k, t in enumerate(o.token_ids):
                last = k == len(o.token_ids) - 1
                yield TokenEvent(
                    self.request_id,
                    t,
                    finish_reason=o.finish_reason if last else "",
                    index=i,
                    final=last and i == len(self.outs) - 1,
                )

    def cancel(self):
        pass


@pytest.fixture(scope="module")
def served(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    model = ModelClient(llm)
    front = Frontend(
        FrontendConfig(
            "m",
            str(tiny_dirs["llama"]),
            "unused:0",
            max_model_len=2048,
            chat_template=load_chat_template("tool_hermes"),
        ),
        client=model,
    )
    http = TestClient(front.app)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), model


@pytest.mark.parametrize(
    "choice, names",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_a_forced_call_from_the_tiny_model_round_trips(served, choice, names):
    """The wire protocol with a random model: the forced call parses and validates; the call and its result go back
    in the next request, whose prompt renders both, and the model answers."""
    client, model = served
    messages = [{"role": "system", "content": "Answer with tools."}, {"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        max_tokens=200,
        temperature=0.7,
        seed=3,
        logit_bias=NO_BLANKS,
    ).choices[0]
    assert first.finish_reason == "tool_calls", first
    call = first.message.tool_calls[0]
    assert call.function.name in names and call.id
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"},
    ]
    final = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER, CLOCK], max_tokens=8, temperature=0
    ).choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls")
    prompt = model.llm.tokenizer.decode(model.prompts[-1], skip_special_tokens=False)
    args = json.dumps(json.loads(call.function.arguments))  # (re-rendered from the object: JSON's own spacing)
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {args}}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
