"""Reasoning split from the answer (``dualpath.serving.reasoning``): however a reply is cut into deltas, the pieces
join to the whole reply's split; the prompt or the reply itself opens the thinking."""

from hypothesis import given, strategies as st

from dualpath.serving.reasoning import ReasoningSplitter, knows_thinking, prompt_opens_thinking

WORDS = ["<think>", "</think>", "<", "</", "</thi", "\n\n", "hmm, ", "so x = 2", " answer", "<tool_call>"]


def split(text: str, thinking: bool, cuts: list[int]) -> tuple[str, str]:
    return splitter(text, thinking, cuts)[:2]


def splitter(text: str, thinking: bool, cuts: list[int]) -> tuple[str, str, ReasoningSplitter]:
    s = ReasoningSplitter(thinking)
    reasoning, answer, last = "", "", 0
    for cut in sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]:
        r, a = s.feed(text[last:cut])
        reasoning, answer, last = reasoning + r, answer + a, cut
    r, a = s.finish()
    return reasoning + r, answer + a, s


def test_known_shapes():
    assert split("so x = 2</think>\n\nThe answer is 2.", True, []) == ("so x = 2", "The answer is 2.")
    assert split("<think>hmm</think>Yes.", False, []) == ("hmm", "Yes.")
    assert split("  <think>hmm</think>Yes.", False, [3]) == ("hmm", "Yes.")
    assert split("Plain answer, </think> kept.", False, []) == ("", "Plain answer, </think> kept.")
    assert split("    indented()", False, [2]) == ("", "    indented()")  # an answer alone keeps its whitespace
    assert split("cut off while thinking </thi", True, [5]) == ("cut off while thinking </thi", "")
    assert split("<thin", False, []) == ("", "<thin")  # the end: not a block after all
    assert split("", True, []) == ("", "")
    pieces = ["so", " x", " = 2", "</th", "ink>", "\n\nTwo", "."]  # one delta per token
    cuts = [sum(map(len, pieces[:k])) for k in range(1, len(pieces))]
    assert splitter("".join(pieces), True, cuts)[2].tokens == 5  # through the closing tag's tokens
    assert splitter("".join(pieces), False, cuts)[2].tokens == 0
    assert splitter("<think>never closed", False, [3, 7, 12])[2].tokens == 4


@given(
    st.lists(st.sampled_from(WORDS), max_size=12).map("".join), st.booleans(), st.lists(st.integers(0, 200), max_size=6)
)
def test_any_cut_joins_to_the_whole_split(text, thinking, cuts):
    assert split(text, thinking, cuts) == split(text, thinking, [])


def test_templates_and_prompts():
    assert knows_thinking("{{ '<think>\\n' }}...{{ '</think>' }}") and not knows_thinking("{{ messages }}")
    assert not knows_thinking(None)
    assert prompt_opens_thinking("<|Assistant|><think>\n")
    assert not prompt_opens_thinking("<|Assistant|></think>") and not prompt_opens_thinking("<think>a</think>")


# --- through the frontend (a scripted test double in place of the cluster) ---------------------------------------
import json  # noqa: E402

import openai  # noqa: E402
import pytest  # noqa: E402

from test_serving import validate  # noqa: E402
from grammar_check import completes, constraint  # noqa: E402
from test_tools import CALL, HERMES_TEMPLATE, WEATHER, serve  # noqa: E402

# DeepSeek-R1's way: the generation prompt opens the thinking, earlier replies lose theirs
R1_TEMPLATE = HERMES_TEMPLATE.replace(
    "{{ message['content'] }}{% endif %}", "{{ message['content'].split('</think>')[-1] }}{% endif %}"
).replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
# Qwen3's way: the model opens the block itself, unless enable_thinking is false (the prompt closes an empty one)
QWEN3_TEMPLATE = HERMES_TEMPLATE.replace(
    "{{ message['content'] }}{% endif %}", "{{ message['content'].split('</think>')[-1] }}{% endif %}"
).replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}",
)
THOUGHT = 'Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>? No.'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def r1(tiny_dirs, tmp_path):
    return serve(tiny_dirs, tmp_path, R1_TEMPLATE)


def chat(http, **body):
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r


def stream(http, path, **body):
    r = http.post(path, json={"model": "m", "stream": True, **body})
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def thinking_tokens(tok, reply: str) -> int:
    """The reply's tokens through the one that completes </think>."""
    ids = tok.encode(reply, add_special_tokens=False)
    return next(k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k]))


def test_a_call_considered_while_thinking_is_not_made_and_the_real_one_is(r1):
    http, fake, tok = r1
    fake.reply = THOUGHT + "</think>\n\nIt is sunny in Paris."
    body = chat(http, tools=[WEATHER]).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT and message["content"] == "It is sunny in Paris."
    assert "tool_calls" not in message
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == thinking_tokens(tok, fake.reply)
    streamed = stream(http, "/v1/chat/completions", messages=ASK, stream_options={"include_usage": True})
    assert streamed[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == thinking_tokens(tok, fake.reply)
    fake.reply = THOUGHT + "</think>" + CALL
    choice = chat(http, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == THOUGHT
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}]


def test_streamed_thinking_and_answer_join_to_the_whole_reply(r1):
    http, fake, _ = r1
    fake.reply = THOUGHT + "</think>\n\nIt is sunny." + CALL
    whole = chat(http, tools=[WEATHER]).json()["choices"][0]["message"]
    chunks = stream(http, "/v1/chat/completions", messages=ASK, tools=[WEATHER])
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"] == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"] == "It is sunny."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["get_weather"]
    assert "".join(c["function"]["arguments"] for c in calls) == whole["tool_calls"][0]["function"]["arguments"]


def test_the_model_may_open_the_block_itself_and_other_replies_are_all_answer(tiny_dirs, tmp_path):
    http, fake, _ = serve(tiny_dirs, tmp_path, QWEN3_TEMPLATE)
    fake.reply = "<think>hmm</think>Yes."
    assert chat(http).json()["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Yes.",
        "refusal": None,
        "reasoning_content": "hmm",
    }
    fake.reply = "  Yes, </think> is a tag."
    message = chat(http).json()["choices"][0]["message"]
    assert message["content"] == "  Yes, </think> is a tag." and message["reasoning_content"] is None
    fake.reply = "2 </think> 3"  # with thinking off the prompt closed the block: all answer
    message = chat(http, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert fake.tokenizer.decode(fake.prompts[-1]).endswith("</think>\n\n")
    assert message["content"] == "2 </think> 3" and message["reasoning_content"] is None


def accepted(sampling, reply: str) -> bool:
    """Whether the engines' constraint for ``sampling`` takes ``reply`` whole (what a guided model could write)."""
    return completes(constraint(sampling), reply)


def test_structured_replies_are_constrained_after_the_thinking(tiny_dirs, tmp_path):
    """JSON output and forced calls of a reasoning model: the engines let it think first (json_thinking "open"
    where the prompt opened the block, "optional" where the model may open one) and constrain what follows; the
    thinking is split off like any reply's."""
    (tmp_path / "r1").mkdir(), (tmp_path / "qwen3").mkdir()
    http, fake, _ = serve(tiny_dirs, tmp_path / "r1", R1_TEMPLATE)
    schema = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"]}
    fake.reply = 'It is warm, say {"temp": 20}.</think>\n\n{"temp": 21}'
    message = chat(
        http, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    ).json()["choices"][0]["message"]
    assert fake.samplings[-1].json_thinking == "open" and accepted(fake.samplings[-1], fake.reply)
    assert message["reasoning_content"] == 'It is warm, say {"temp": 20}.' and message["content"] == '{"temp": 21}'
    fake.reply = (
        THOUGHT + "</think>" + CALL.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>")
    )
    choice = chat(http, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert fake.samplings[-1].json_thinking == "open" and accepted(fake.samplings[-1], fake.reply)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == THOUGHT
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}]
    chunks = stream(http, "/v1/chat/completions", messages=ASK, tools=[WEATHER], tool_choice="required")
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if c.get("id")] == ["get_weather"]

    http, fake, _ = serve(tiny_dirs, tmp_path / "qwen3", QWEN3_TEMPLATE)
    for reply, thought in (('<think>hm</think>\n{"a": 1}', "hm"), ('{"a": 1}', None)):
        fake.reply = reply
        message = chat(http, response_format={"type": "json_object"}).json()["choices"][0]["message"]
        assert fake.samplings[-1].json_thinking == "optional" and accepted(fake.samplings[-1], reply)
        assert message["content"] == '{"a": 1}' and message["reasoning_content"] == thought
    assert not accepted(fake.samplings[-1], '</think>{"a": 1}')


def test_the_parser_can_be_turned_off_and_is_off_for_templates_without_thinking(tiny_dirs, tmp_path):
    (tmp_path / "a").mkdir()
    http, fake, _ = serve(tiny_dirs, tmp_path / "a", R1_TEMPLATE, reasoning_parser="none")
    fake.reply = "x</think>y"
    assert "reasoning_content" not in chat(http).json()["choices"][0]["message"]
    chat(http, response_format={"type": "json_object"})
    assert fake.samplings[-1].json_thinking == ""  # constrained from the first token
    (tmp_path / "b").mkdir()
    http, fake, _ = serve(tiny_dirs, tmp_path / "b", HERMES_TEMPLATE)
    fake.reply = "x</think>y"
    assert chat(http).json()["choices"][0]["message"]["content"] == "x</think>y"
    chat(http, response_format={"type": "json_object"})
    assert fake.samplings[-1].json_thinking == ""


def test_responses_put_the_thinking_in_a_reasoning_item(r1):
    http, fake, _ = r1
    fake.reply = THOUGHT + "</think>It is sunny."
    body = http.post("/v1/responses", json={"model": "m", "input": "Weather in Paris?"}).json()
    validate("Response", body)
    assert [o["type"] for o in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"][0]["text"] == THOUGHT
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking_tokens(fake.tokenizer, fake.reply)
    events = stream(http, "/v1/responses", input="Weather in Paris?")
    schema = {
        "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
        "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
        "response.output_item.added": "ResponseOutputItemAddedEvent",
        "response.output_item.done": "ResponseOutputItemDoneEvent",
        "response.completed": "ResponseCompletedEvent",
    }
    for e in events:
        if e["type"] in schema:
            validate(schema[e["type"]], e)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    with client.responses.stream(model="m", input="Weather in Paris?") as s:
        got = s.get_final_response()
    assert got.output_text == "It is sunny." and got.output[0].content[0].text == THOUGHT
    # sent back as input (an agent managing its own context), the reasoning item is left out of the prompt
    client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            got.output[0].model_dump(exclude_none=True),
            {"role": "user", "content": "And Rome?"},
        ],
    )
    without = client.responses.create(
        model="m", input=[{"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "And Rome?"}]
    )
    assert without.output_text and fake.prompts[-1] == fake.prompts[-2]
