"""OpenAI's Responses API (``/v1/responses``) with a scripted test double in place of the cluster: the prompt is the
chat the items describe (rendered by the model's template), replies become output items (text, function calls),
``previous_response_id`` continues a stored conversation, the stream's events build the same response (through the
``openai`` client's own stream helper) and match the published schemas, and what is not supported is a 400 naming
the field."""

import json

from dataclasses import replace

import openai
import pytest

from dualpath.core.messages import TokenEvent
from dualpath.serving.response_store import DirectoryResponses, MemoryResponses
from test_serving import validate
from test_tools import CALL, HERMES_TEMPLATE, WEATHER, ScriptedHandle, serve

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat form


@pytest.fixture
def front(tiny_dirs, tmp_path):
    return serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)


class Cut(ScriptedHandle):
    """A reply cut at max_tokens."""

    def events(self):
        for ev in super().events():
            yield replace(ev, finish_reason="length") if ev.finish_reason else ev


class Aborted(ScriptedHandle):
    """A reply ended by /abort_request."""

    def events(self):
        for ev in super().events():
            yield replace(ev, finish_reason="abort") if ev.finish_reason else ev


class Empty(ScriptedHandle):
    """A reply whose first event ends it (an end-of-sequence token, not shown)."""

    def events(self):
        yield TokenEvent(self.request_id, -1, finish_reason="stop", final=True)


def sdk(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def chat_prompt(http, fake, messages, **extra) -> list[int]:
    """The prompt the chat endpoint submits for ``messages``: what a Responses request must submit too."""
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, **extra})
    assert r.status_code == 200, r.text
    return fake.prompts[-1]


def test_a_reply_is_one_message_item_and_the_prompt_is_the_chat(front):
    http, fake, tok = front
    fake.reply = "Hello there."
    r = http.post(
        "/v1/responses",
        json={"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    validate("Response", body)
    prompt = fake.prompts[-1]
    assert prompt == chat_prompt(
        http, fake, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert fake.samplings[-2].max_tokens == 20 and fake.samplings[-2].temperature == 0.5
    assert body["status"] == "completed" and body["id"].startswith("resp_")
    [item] = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello there."
    assert body["usage"]["input_tokens"] == len(prompt) and body["usage"]["output_tokens"] == len(
        tok.encode("Hello there.", add_special_tokens=False)
    )
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": len(prompt) // 16 * 16}
    assert sdk(http).responses.create(model="m", input="hi").output_text == "Hello there."
    # OpenAI's developer role is the system role for a template that does not know it
    http.post(
        "/v1/responses",
        json={
            "model": "m",
            "input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        },
    )
    assert fake.prompts[-1] == prompt


def test_calls_come_back_as_items_and_a_continued_turn_sends_the_whole_conversation(front):
    """A reply's text and call, then the call's output sent with previous_response_id: the second prompt is the
    chat of the whole conversation (the first turn's instructions are not carried over, as OpenAI's are not)."""
    http, fake, _ = front
    client = sdk(http)
    fake.reply = "Let me check. " + CALL
    first = client.responses.create(model="m", input="Weather in Paris?", tools=[TOOL], instructions="Be brief.")
    message, call = first.output
    assert message.type == "message" and message.content[0].text.strip() == "Let me check."
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    fake.reply = "It is sunny."
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}],
    )
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    continued = fake.prompts[-1]
    assert continued == chat_prompt(
        http,
        fake,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": message.content[0].text,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, sunny"},
        ],
        tools=[WEATHER],
    )
    # the same conversation sent whole, as items, renders the same prompt
    client.responses.create(
        model="m",
        tools=[TOOL],
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message.content[0].text}],
            },
            {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"},
        ],
    )
    assert fake.prompts[-1] == continued


def test_the_stream_builds_the_same_response_and_its_events_follow_the_schemas(front):
    http, fake, _ = front
    fake.reply = "Let me check. " + CALL
    r = http.post("/v1/responses", json={"model": "m", "input": "Weather in Paris?", "tools": [TOOL], "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    schema = {
        "response.created": "ResponseCreatedEvent",
        "response.in_progress": "ResponseInProgressEvent",
        "response.output_item.added": "ResponseOutputItemAddedEvent",
        "response.output_item.done": "ResponseOutputItemDoneEvent",
        "response.content_part.added": "ResponseContentPartAddedEvent",
        "response.content_part.done": "ResponseContentPartDoneEvent",
        "response.output_text.delta": "ResponseTextDeltaEvent",
        "response.output_text.done": "ResponseTextDoneEvent",
        "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
        "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
        "response.completed": "ResponseCompletedEvent",
    }
    for e in events:
        validate(schema[e["type"]], e)
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and text.strip() == "Let me check."
    assert final["output"][1]["type"] == "function_call" and final["usage"]["output_tokens"] > 0
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(args) > 2 and [final["output"][1]["arguments"]] == done == ["".join(args)]  # streamed as written
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i.get("arguments")) for i in added] == [("message", None), ("function_call", "")]
    with sdk(http).responses.stream(model="m", input="Weather in Paris?", tools=[TOOL]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    whole = sdk(http).responses.create(model="m", input="Weather in Paris?", tools=[TOOL])
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert [(o.type, getattr(o, "arguments", None)) for o in streamed.output] == [
        (o.type, getattr(o, "arguments", None)) for o in whole.output
    ]
    stored = http.get(f"/v1/responses/{streamed.id}").json()  # a streamed response is stored once complete
    assert stored["id"] == streamed.id and stored["status"] == "completed"


def test_a_cut_reply_is_incomplete_and_stored_responses_can_be_read_and_deleted(front):
    http, fake, tok = front
    fake.reply = lambda s: Cut([tok.encode("one two three", add_special_tokens=False)])
    body = http.post("/v1/responses", json={"model": "m", "input": "count", "max_output_tokens": 3}).json()
    validate("Response", body)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["output"][0]["content"][0]["text"] == "one two three"
    r = http.post("/v1/responses", json={"model": "m", "input": "count", "max_output_tokens": 3, "stream": True})
    last = json.loads([line for line in r.text.splitlines() if line.startswith("data: ")][-1][6:])
    assert (
        last["type"] == "response.incomplete"
        and last["response"]["incomplete_details"]["reason"] == "max_output_tokens"
    )
    validate("ResponseIncompleteEvent", last)
    fake.reply = lambda s: Aborted([tok.encode("one two", add_special_tokens=False)])
    aborted = http.post("/v1/responses", json={"model": "m", "input": "count"}).json()
    validate("Response", aborted)
    assert aborted["status"] == "incomplete" and aborted["incomplete_details"] is None
    assert aborted["output"][0]["status"] == "incomplete" and aborted["output"][0]["content"][0]["text"] == "one two"
    fake.reply = "ok"
    rid = body["id"]
    assert http.get(f"/v1/responses/{rid}").json() == body
    assert http.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
    assert http.get(f"/v1/responses/{rid}").status_code == 404
    unstored = http.post("/v1/responses", json={"model": "m", "input": "hi", "store": False}).json()
    assert http.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_an_empty_reply_is_one_empty_message(front):
    http, fake, _ = front
    fake.reply = lambda s: Empty([])
    body = http.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
    assert [o["type"] for o in body["output"]] == ["message"] and body["output"][0]["content"][0]["text"] == ""
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    final = json.loads([line for line in r.text.splitlines() if line.startswith("data: ")][-1][6:])["response"]
    assert [o["type"] for o in final["output"]] == ["message"]


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "no stored response"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text only"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "not supported"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "context"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "takes no reasoning_effort"),  # the template reads none
        ({"reasoning": {"effort": "extreme"}}, "reasoning", "should be 'none', 'minimal'"),
        ({"reasoning": {"summary": "auto"}}, "reasoning", "only effort"),
        ({"truncation": "middle"}, "truncation", "disabled"),
        ({"background": True}, "background", "not supported"),
        ({"include": ["file_search_call.results"]}, "include", "cannot be included"),
        ({"text": {"format": {"type": "grammar"}}}, "text", "not supported"),
        ({"text": {"format": "json_object"}}, "text", "an object"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": 3, "arguments": "{}"}]}, "input", "a string"),
        ({"input": []}, "input", "at least 1"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice", "tool_choice"),
        ({"temperature": 3}, "temperature", "less than or equal"),
    ],
)
def test_unsupported_or_bad_fields_are_a_400_naming_them(front, extra, param, message):
    http, fake, _ = front
    fake.reply = "ok"
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_auto_truncation_drops_the_earliest_whole_exchanges_that_make_it_fit(front):
    """truncation "auto": the fewest earliest exchanges are dropped (a tool call with its output, never one
    without the other), the instructions kept; without it, or when even the last turn does not fit, a 400."""
    http, fake, _ = front
    fake.reply = "ok"
    said = ["a" * 300, "b" * 10, "c" * 120]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [
        {"role": "user", "content": said[0]},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "x" * 10},
        {"role": "assistant", "content": said[1]},
        {"role": "user", "content": said[2]},
        {"role": "assistant", "content": "d" * 60},
        {"role": "user", "content": "last?"},
    ]
    system = {"role": "system", "content": "Be brief."}
    kept = chat_prompt(
        http,
        fake,
        [
            system,
            {"role": "user", "content": said[2]},
            {"role": "assistant", "content": "d" * 60},
            {"role": "user", "content": "last?"},
        ],
        tools=[WEATHER],
    )
    # room for the kept turns and ~100 tokens more: enough for the tool output and "b" too, but a cut there would
    # leave an output without its call
    http.front.cfg = replace(http.front.cfg, max_model_len=len(kept) + 20 + 100)
    body = {"model": "m", "input": items, "instructions": "Be brief.", "tools": [TOOL], "max_output_tokens": 20}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert fake.prompts[-1] == kept and r.json()["truncation"] == "auto"
    validate("Response", r.json())
    assert r.json()["usage"]["input_tokens"] == len(kept)
    r = http.post("/v1/responses", json={**body, "truncation": "auto", "max_output_tokens": 10})
    assert fake.prompts[-1] == kept  # a little more room: still the same cut (whole exchanges only)
    r = http.post(
        "/v1/responses",
        json={
            **body,
            "truncation": "auto",
            "input": items + [{"role": "assistant", "content": "e"}, {"role": "user", "content": "z" * 400}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # the last turn alone


def test_a_stored_response_lists_its_input_items(front):
    """``GET /v1/responses/{id}/input_items``: the request's own input, each item in its resource form with an id
    (valid against the published schema), newest first unless asked, paged by item ids; the SDK's pager walks it."""
    http, fake, _ = front
    fake.reply = "It is sunny."
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "message", "role": "assistant", "content": "Sunny, 21 C.", "id": "msg_mine"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    rid = http.post("/v1/responses", json={"model": "m", "input": items, "tools": [TOOL]}).json()["id"]
    page = http.get(f"/v1/responses/{rid}/input_items").json()
    validate("ResponseItemList", page)
    data = page["data"][::-1]  # newest first
    assert [(d["type"], d.get("role")) for d in data] == [
        ("message", "developer"),
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert data[1]["content"] == [{"type": "input_text", "text": "Weather in Paris?"}] and data[4]["id"] == "msg_mine"
    assert (data[2]["call_id"], data[2]["arguments"], data[3]["output"]) == ("call_1", '{"city": "Paris"}', "21 C")
    assert not page["has_more"] and (page["first_id"], page["last_id"]) == (data[-1]["id"], data[0]["id"])
    ids = [d["id"] for d in data]
    first = http.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 4}).json()
    assert [d["id"] for d in first["data"]] == ids[:4] and first["has_more"]
    rest = http.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "after": ids[3]}).json()
    assert [d["id"] for d in rest["data"]] == ids[4:] and not rest["has_more"]
    back = http.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "before": ids[4], "limit": 2}).json()
    assert [d["id"] for d in back["data"]] == ids[2:4] and back["has_more"]
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    assert [d.id for d in client.responses.input_items.list(rid, order="asc", limit=2)] == ids  # every page
    text = http.post("/v1/responses", json={"model": "m", "input": "Hi"}).json()["id"]
    (only,) = http.get(f"/v1/responses/{text}/input_items").json()["data"]
    assert only["role"] == "user" and only["content"][0]["text"] == "Hi"
    for query, param in (
        ({"limit": 0}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_nope"}, "after"),
    ):
        r = http.get(f"/v1/responses/{rid}/input_items", params=query)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.get(f"/v1/responses/resp_{'0' * 32}/input_items").status_code == 404


def test_the_memory_store_keeps_the_most_recently_used():
    store = MemoryResponses(2)
    for rid in ("a", "b"):
        store.put({"id": rid}, [])
    assert store.get("a") is not None
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")
    MemoryResponses(0).put({"id": "x"}, [])  # capacity 0: nothing kept, nothing fails


def test_the_directory_store_is_shared_bounded_and_never_raises(tmp_path, caplog):
    a, b = DirectoryResponses(tmp_path / "r", 20), DirectoryResponses(tmp_path / "r", 20)  # two frontends
    ids = [f"resp_{i:032x}" for i in range(25)]
    for rid in ids:
        a.put({"id": rid}, [{"role": "user", "content": rid}])
    assert b.get(ids[-1]) == ({"id": ids[-1]}, [{"role": "user", "content": ids[-1]}], [])
    assert len(list((tmp_path / "r").glob("*.json"))) <= 22 and b.get(ids[0]) is None  # the oldest went
    assert b.delete(ids[-1]) and not a.delete(ids[-1]) and a.get(ids[-1]) is None
    assert a.get("../../etc/passwd") is None and not a.delete("resp_../x")  # only ids the frontend makes
    (tmp_path / "r" / f"{ids[-2]}.json").write_text("{not json")
    assert a.get(ids[-2]) is None
    (tmp_path / "r" / f"resp_{'f' * 32}.json").mkdir()  # a path that cannot be written: logged, not raised
    a.put({"id": f"resp_{'f' * 32}"}, [])
    assert "not stored" in caplog.text and not list((tmp_path / "r").glob("*.tmp*"))


def test_any_frontend_continues_a_conversation_another_stored(tiny_dirs, tmp_path):
    """Two frontend replicas over one responses directory (the KV store's filesystem): a turn answered by one is
    continued through the other, and read and deleted there."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    shared = str(tmp_path / "responses")
    http_a, fake_a, _ = serve(tiny_dirs, tmp_path / "a", HERMES_TEMPLATE, responses_dir=shared)
    http_b, fake_b, _ = serve(tiny_dirs, tmp_path / "b", HERMES_TEMPLATE, responses_dir=shared)
    fake_a.reply = fake_b.reply = "Paris."
    first = sdk(http_a).responses.create(model="m", input="Capital of France?")
    second = sdk(http_b).responses.create(model="m", input="And of Italy?", previous_response_id=first.id)
    assert second.output_text == "Paris."
    assert fake_b.prompts[-1] == chat_prompt(
        http_b,
        fake_b,
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
    )
    assert http_b.get(f"/v1/responses/{first.id}").json()["id"] == first.id
    assert http_b.delete(f"/v1/responses/{first.id}").status_code == 200
    assert http_a.get(f"/v1/responses/{first.id}").status_code == 404
