"""The HTTP frontend's smaller surface, with a scripted test double in place of the cluster: OpenAI's penalties and
logit bias and vLLM's extra sampling fields (``stop_token_ids``, ``ignore_eos``, ``repetition_penalty``, ``min_p``,
``min_tokens``) reach the engines' sampling parameters, out-of-range values and values of another JSON type (a
boolean for a number, a number for a boolean) are a 400 on every endpoint, fields that would change the
answer but are not implemented are a 400 rather than silently ignored, and vLLM's
``/tokenize`` and ``/detokenize`` agree with the tokenizer and the chat endpoint."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from dualpath.core.errors import DualPathError
from dualpath.core.messages import TokenEvent
from dualpath.core.sampling_params import SamplingParams
from dualpath.serving.protocol import CompletionRequest
from test_serving import validate
from test_tools import CALL, HERMES_TEMPLATE, WEATHER, ask, serve


@pytest.fixture
def front(tiny_dirs, tmp_path):
    return serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)


def post(http, path, **body):
    return http.post(path, json=body)


def test_stop_token_ids_and_ignore_eos_reach_the_sampling_parameters(front):
    http, fake, _ = front
    fake.reply = "ok"
    r = post(http, "/v1/completions", model="m", prompt="hi", stop_token_ids=[7, 258], ignore_eos=True)
    assert r.status_code == 200, r.text
    assert fake.samplings[-1].stop_token_ids == (7, 258) and fake.samplings[-1].ignore_eos
    post(http, "/v1/chat/completions", model="m", messages=[{"role": "user", "content": "hi"}])
    assert fake.samplings[-1].stop_token_ids == () and not fake.samplings[-1].ignore_eos


def test_penalties_bias_min_p_and_min_tokens_reach_the_sampling_parameters(front):
    http, fake, _ = front
    fake.reply = "ok"
    knobs = dict(
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        repetition_penalty=1.3,
        min_p=0.05,
        min_tokens=2,
        logit_bias={"258": -100, "7": 2.5},
    )
    for path, body in (
        ("/v1/completions", dict(prompt="hi")),
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}])),
    ):
        r = post(http, path, model="m", max_tokens=8, **knobs, **body)
        assert r.status_code == 200, r.text
        s = fake.samplings[-1]
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (
            0.5,
            -1.5,
            1.3,
            0.05,
            2,
        )
        assert s.logit_bias == ((7, 2.5), (258, -100.0)) and s.needs_history
    post(http, "/v1/completions", model="m", prompt="hi")
    s = fake.samplings[-1]
    assert s.logit_bias == () and not s.needs_history and s.min_p == 0.0


def test_min_tokens_holds_back_stop_strings(front):
    """A stop string inside the first ``min_tokens`` tokens does not end the reply; one after them does."""
    http, fake, tok = front
    fake.reply = "ab. cd. ef. gh"
    n_first = len(tok.encode("ab.", add_special_tokens=False))
    r = post(http, "/v1/completions", model="m", prompt="hi", stop=["."])
    assert r.json()["choices"][0]["text"] == "ab"
    r = post(http, "/v1/completions", model="m", prompt="hi", stop=["."], min_tokens=n_first + 1)
    assert r.json()["choices"][0]["text"] == "ab. cd", r.text


def test_bad_words_reach_the_engines_as_token_sequences_at_the_start_and_after_a_space(front):
    http, fake, tok = front
    fake.reply = "ok"
    r = post(http, "/v1/completions", model="m", prompt="hi", bad_words=["hello there", " x"])
    assert r.status_code == 200, r.text
    want = [tuple(tok.encode(t, add_special_tokens=False)) for t in ("hello there", " hello there", "x", " x")]
    assert fake.samplings[-1].bad_words == tuple(dict.fromkeys(want))
    assert fake.samplings[-1].needs_history


def test_vllm_text_and_token_options(front):
    """allowed_token_ids, include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens and
    add_special_tokens do what vLLM's do."""
    http, fake, tok = front
    fake.reply = "ab. cd"
    r = post(
        http,
        "/v1/completions",
        model="m",
        prompt="hi",
        stop=["."],
        include_stop_str_in_output=True,
        allowed_token_ids=[97, 98, 46],
        skip_special_tokens=False,
    )
    assert r.json()["choices"][0]["text"] == "ab.", r.text
    s = fake.samplings[-1]
    assert s.allowed_token_ids == (97, 98, 46) and s.include_stop_str_in_output and not s.skip_special_tokens
    streamed = [
        json.loads(line[6:])
        for line in post(
            http, "/v1/completions", model="m", prompt="hi", stop=["."], include_stop_str_in_output=True, stream=True
        ).text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in streamed) == "ab."
    fake.reply = "x<|im_end|>"  # a special token's text in the reply
    assert post(http, "/v1/completions", model="m", prompt="hi").json()["choices"][0]["text"] == "x"
    r = post(http, "/v1/completions", model="m", prompt="hi", skip_special_tokens=False)
    assert r.json()["choices"][0]["text"] == "x<|im_end|>"
    fake.reply = "ok"
    long = "the quick brown fox " * 4
    r = post(http, "/v1/completions", model="m", prompt=long, truncate_prompt_tokens=5)
    assert fake.prompts[-1] == tok.encode(long)[-5:] and r.json()["usage"]["prompt_tokens"] == 5
    post(
        http, "/v1/chat/completions", model="m", messages=[{"role": "user", "content": long}], truncate_prompt_tokens=7
    )
    assert len(fake.prompts[-1]) == 7
    post(http, "/v1/completions", model="m", prompt=long, add_special_tokens=False)
    assert fake.prompts[-1] == tok.encode(long, add_special_tokens=False)


def test_json_mode_reaches_the_sampling_parameters(front):
    http, fake, _ = front
    fake.reply = "{}"
    for path, body in (
        ("/v1/completions", dict(prompt="hi")),
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}])),
    ):
        assert post(http, path, model="m", response_format={"type": "json_object"}, **body).status_code == 200
        assert fake.samplings[-1].json_object
        assert post(http, path, model="m", response_format={"type": "text"}, **body).status_code == 200
        assert not fake.samplings[-1].json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    r = post(http, "/v1/chat/completions", model="m", response_format=fmt, messages=[{"role": "user", "content": "hi"}])
    assert r.status_code == 200, r.text
    assert json.loads(fake.samplings[-1].json_schema) == schema and not fake.samplings[-1].json_object
    # vLLM's extras for the same
    for extra, want in (
        (dict(guided_json=schema), schema),
        (dict(guided_json=json.dumps(schema)), schema),
        (dict(structured_outputs={"json": schema}), schema),
        (dict(structured_outputs={"json_object": True}), None),
    ):
        r = post(http, "/v1/completions", model="m", prompt="hi", **extra)
        assert r.status_code == 200, r.text
        s = fake.samplings[-1]
        assert (json.loads(s.json_schema) if s.json_schema else None) == want and s.json_object == (want is None)
    # patterns and choices (vLLM's guided_regex / guided_choice, structured_outputs regex / choice)
    for extra, want in (
        (dict(guided_regex=r"\d{3}"), r"\d{3}"),
        (dict(structured_outputs={"regex": "a|b"}), "a|b"),
        (dict(guided_choice=["yes", "no (2)"]), r"(?:yes|no\ \(2\))"),
        (dict(structured_outputs={"choice": ["a.b"]}), r"(?:a\.b)"),
    ):
        for path, body in (
            ("/v1/completions", dict(prompt="hi")),
            ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}])),
        ):
            r = post(http, path, model="m", **extra, **body)
            assert r.status_code == 200, r.text
            s = fake.samplings[-1]
            assert s.regex == want and s.json_schema is None and not s.json_object
    # tools withheld by tool_choice "none": JSON mode is fine
    r = post(
        http, "/v1/chat/completions", model="m", response_format={"type": "json_object"}, tool_choice="none", **ask()
    )
    assert r.status_code == 200 and fake.samplings[-1].json_object


def test_grammars_reach_the_sampling_parameters_and_bad_ones_are_400s_naming_why(front):
    """vLLM's guided_grammar and structured_outputs grammar (GBNF), on both APIs; a left-recursive grammar is fine
    (llguidance parses with Earley); one naming an undefined rule is a 400 that says so (never a failed
    generation)."""
    http, fake, _ = front
    fake.reply = "a,b"
    grammar = 'root ::= item ("," item)*\nitem ::= [a-z]+'
    for extra in (dict(guided_grammar=grammar), dict(structured_outputs={"grammar": grammar})):
        for path, body in (
            ("/v1/completions", dict(prompt="hi")),
            ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}])),
        ):
            r = post(http, path, model="m", **extra, **body)
            assert r.status_code == 200, r.text
            s = fake.samplings[-1]
            assert s.grammar == grammar and s.regex is None and s.json_schema is None and not s.json_object
    r = post(http, "/v1/completions", model="m", prompt="hi", guided_grammar='root ::= root "+" "1" | "1"')
    assert r.status_code == 200, r.text
    r = post(http, "/v1/completions", model="m", prompt="hi", guided_grammar='root ::= "1" more')
    assert r.status_code == 400 and "more" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "guided_grammar"


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(guided_regex="(a"), "guided_regex"),
        (dict(guided_regex=r"(a)\1"), "guided_regex"),
        (dict(guided_regex="(?=a)a"), "guided_regex"),
        (dict(guided_choice=[]), "guided_choice"),
        (dict(guided_choice=[""]), "guided_choice"),
        (dict(guided_choice="a"), "guided_choice"),
        (dict(guided_grammar="root ::= x"), "guided_grammar"),
        (dict(structured_outputs={"grammar": "root ::= x"}), "structured_outputs"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (dict(structured_outputs={"regex": "a{2,1}"}), "structured_outputs"),
        (dict(guided_regex="a", guided_choice=["a"]), None),
        (dict(guided_json="not json"), "guided_json"),
        (dict(guided_json={"type": "array", "uniqueItems": True}), "guided_json"),
        (dict(guided_json={"type": "object"}, response_format={"type": "json_object"}), None),
    ],
)
def test_structured_output_requests_that_cannot_be_honoured_are_400s(front, body, param):
    http, fake, _ = front
    r = post(http, "/v1/completions", model="m", prompt="hi", **body)
    assert r.status_code == 400, r.text
    assert param is None or r.json()["error"]["param"] == param, r.json()
    assert not fake.samplings


def test_a_grammar_that_takes_too_long_to_compile_is_a_400(front, monkeypatch):
    """Compiling and checking is bounded by a time limit (here 1 s): a grammar llguidance never comes back from
    (two greedy tokens of one language in a row) is a 400 saying so, not a stuck request; the next one is served."""
    from dualpath.core import structured

    http, fake, _ = front
    fake.reply = "aaa"
    monkeypatch.setattr(structured, "COMPILE_SECONDS", 1.0)
    r = post(http, "/v1/completions", model="m", prompt="hi", guided_grammar='root ::= r r\nr ::= "a"+')
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar"
    assert "took longer than 1 s" in r.json()["error"]["message"] and not fake.samplings
    assert post(http, "/v1/completions", model="m", prompt="hi", guided_grammar='root ::= "a"+').status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", dict(prompt="hi", stop_token_ids=[10**6]), "stop_token_ids"),
        ("/v1/completions", dict(prompt="hi", best_of=1, n=2), "best_of"),
        ("/v1/completions", dict(prompt="hi", best_of=17), "best_of"),
        ("/v1/completions", dict(prompt="hi", best_of=3, stream=True), "best_of"),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "x"}], functions=[WEATHER["function"]]),
            "functions",
        ),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "x"}], modalities=["text", "audio"]),
            "modalities",
        ),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_not_ignored(front, path, body, param):
    http, fake, _ = front
    r = post(http, path, model="m", **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not fake.prompts


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(use_beam_search=True), "use_beam_search"),
        (dict(length_penalty=0.5), "length_penalty"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=1, stream=True), None),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(bad_words=["x"], response_format={"type": "json_object"}), "bad_words"),
        (dict(logits_processors=["a.b"]), "logits_processors"),
        (dict(echo=True), "echo"),
        (dict(add_special_tokens=True), "add_special_tokens"),
        (dict(documents=[{"text": "d"}]), "documents"),
        (dict(documents=["not an object"]), "documents"),
        (dict(reasoning_effort="high"), "reasoning_effort"),
        (dict(reasoning_effort="max"), "reasoning_effort"),
        (dict(chat_template="{{ messages }}"), "chat_template"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1], response_format={"type": "json_object"}), "allowed_token_ids"),
    ],
)
def test_vllm_extras_that_are_not_implemented_or_out_of_range_are_400s(front, body, param):
    http, fake, _ = front
    r = post(http, "/v1/chat/completions", model="m", messages=[{"role": "user", "content": "x"}], **body)
    assert r.status_code == 400 and (param is None or r.json()["error"]["param"] == param), r.text
    assert not fake.prompts
    neutral = dict(
        use_beam_search=False,
        length_penalty=1.0,
        prompt_logprobs=None,
        bad_words=[],
        echo=False,
        add_special_tokens=False,
        spaces_between_special_tokens=False,
        allowed_token_ids=[],
    )
    fake.reply = "ok"
    assert (
        post(
            http, "/v1/chat/completions", model="m", messages=[{"role": "user", "content": "x"}], **neutral
        ).status_code
        == 200
    )


def test_a_requests_own_chat_template_renders_its_chat_when_the_server_trusts_them(tiny_dirs, tmp_path):
    """vLLM's ``--trust-request-chat-template``: the request's template renders the chat (compiled once); one that
    does not parse is a 400 naming it. Without the flag the field is refused (above)."""
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, trust_request_chat_template=True)
    fake.reply = "ok"
    own = "{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        assert post(http, "/v1/chat/completions", model="m", messages=messages, chat_template=own).status_code == 200
        assert fake.prompts[-1] == tok.with_chat_template(own).apply_chat_template(messages)
        assert tok.decode(fake.prompts[-1]) == "<<user: hi>>"
    assert post(http, "/v1/chat/completions", model="m", messages=messages).status_code == 200
    assert fake.prompts[-1] == tok.apply_chat_template(messages)  # the server's own again
    r = post(http, "/v1/chat/completions", model="m", messages=messages, chat_template="{% for %}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    rag = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1].content }}"
    docs = [{"title": "a", "text": "alpha"}, {"title": "b", "text": "beta"}]
    assert (
        post(http, "/v1/chat/completions", model="m", messages=messages, chat_template=rag, documents=docs).status_code
        == 200
    )
    assert tok.decode(fake.prompts[-1]) == "[a: alpha][b: beta]hi"  # vLLM's documents, for RAG templates


def test_reasoning_effort_is_the_templates_variable_on_chats_and_responses(tiny_dirs, tmp_path):
    """OpenAI's ``reasoning_effort`` (and the Responses API's ``reasoning.effort``) reach a template that reads it
    (gpt-oss's does); ``chat_template_kwargs`` still win; a template without it refuses it (above)."""
    template = "[{{ reasoning_effort | default('medium') }}]{{ messages[-1].content }}"
    http, fake, tok = serve(tiny_dirs, tmp_path, template)
    fake.reply = "ok"
    messages = [{"role": "user", "content": "hi"}]
    for extra, want in (
        (dict(), "[medium]hi"),
        (dict(reasoning_effort="high"), "[high]hi"),
        (dict(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}), "[low]hi"),
    ):
        assert post(http, "/v1/chat/completions", model="m", messages=messages, **extra).status_code == 200
        assert tok.decode(fake.prompts[-1]) == want
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "reasoning": {"effort": "minimal"}})
    assert r.status_code == 200 and tok.decode(fake.prompts[-1]) == "[minimal]hi"
    assert r.json()["reasoning"] == {"effort": "minimal", "summary": None}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", dict(prompt="hi", logit_bias={str(10**6): 5}), "logit_bias"),
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logit_bias={"a": 1}), "logit_bias"),
        ("/v1/completions", dict(prompt="hi", logit_bias={"5": 101}), "logit_bias"),
        ("/v1/completions", dict(prompt="hi", logit_bias={"5": 1, "05": 2}), "logit_bias"),
        ("/v1/completions", dict(prompt="hi", logit_bias={"-5": 1}), "logit_bias"),
        ("/v1/completions", dict(prompt="hi", presence_penalty=2.5), "presence_penalty"),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "x"}], frequency_penalty=-3),
            "frequency_penalty",
        ),
        ("/v1/completions", dict(prompt="hi", repetition_penalty=0), "repetition_penalty"),
        ("/v1/completions", dict(prompt="hi", min_p=1.5), "min_p"),
        ("/v1/completions", dict(prompt="hi", max_tokens=4, min_tokens=5), "min_tokens"),
        ("/v1/completions", dict(prompt="hi", min_tokens=-1), "min_tokens"),
    ],
)
def test_out_of_range_sampling_values_are_400s(front, path, body, param):
    http, fake, _ = front
    r = post(http, path, model="m", **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not fake.prompts


CHAT, COMPLETION, RESPONSE = (
    dict(model="m", messages=[{"role": "user", "content": "x"}]),
    dict(model="m", prompt="hi"),
    dict(model="m", input="hi"),
)
# (endpoint, a valid body, a field, a value of the wrong JSON type for it, the field an error names): OpenAI's API
# types every field strictly, a boolean is no number, a number no boolean, a string neither
MISTYPED = [
    *[
        ("/v1/chat/completions", CHAT, f, v, f)
        for f, v in [
            ("max_tokens", True),
            ("max_completion_tokens", True),
            ("n", True),
            ("temperature", True),
            ("top_p", False),
            ("seed", True),
            ("top_logprobs", True),
            ("logprobs", 1),
            ("stream", 0),
            ("presence_penalty", True),
            ("frequency_penalty", True),
            ("top_k", True),
            ("min_tokens", True),
            ("priority", True),
            ("min_p", True),
            ("repetition_penalty", True),
            ("ignore_eos", 1),
            ("skip_special_tokens", "false"),
            ("temperature", "0.5"),
            ("max_tokens", "5"),
            ("max_tokens", 5.0),
            ("n", 1.0),
            ("parallel_tool_calls", 1),
            ("logit_bias", {"5": True}),
            ("stop_token_ids", [True]),
            ("allowed_token_ids", [1.0]),
            ("stop", 1),
            ("messages", [{"role": "user", "content": 5}]),
            ("stream_options", {"include_usage": 1}),
            ("dualpath", {"usage": 1}),
            ("add_generation_prompt", 1),
            ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}),
            ("structured_outputs", {"json_object": 1}),
            ("model", 1),
        ]
    ],
    *[
        ("/v1/completions", COMPLETION, f, v, f)
        for f, v in [
            ("max_tokens", True),
            ("logprobs", True),
            ("n", True),
            ("best_of", True),
            ("echo", 1),
            ("seed", "1"),
            ("temperature", True),
            ("prompt", [True, False]),
            ("add_special_tokens", 0),
            ("truncate_prompt_tokens", True),
            ("prompt_logprobs", True),
            ("include_stop_str_in_output", 1),
        ]
    ],
    *[
        ("/v1/responses", RESPONSE, f, v, f)
        for f, v in [
            ("max_output_tokens", True),
            ("temperature", True),
            ("top_p", True),
            ("top_logprobs", True),
            ("store", 1),
            ("stream", 1),
            ("parallel_tool_calls", 1),
            ("seed", True),
            ("top_k", True),
            ("instructions", 1),
        ]
    ],
    ("/tokenize", dict(prompt="hi"), "add_special_tokens", 1, "add_special_tokens"),
    ("/tokenize", dict(), "prompt", 5, "prompt"),
    ("/detokenize", dict(), "tokens", [True], "tokens"),
    ("/generate", dict(text="hi"), "return_logprob", 1, "return_logprob"),
    ("/generate", dict(text="hi"), "top_logprobs_num", True, "top_logprobs_num"),
    ("/generate", dict(text="hi"), "input_ids", [True], "input_ids"),
    ("/generate", dict(text="hi"), "sampling_params", {"max_new_tokens": True}, "sampling_params.max_new_tokens"),
    ("/generate", dict(text="hi"), "sampling_params", {"temperature": True}, "sampling_params.temperature"),
    ("/generate", dict(text="hi"), "sampling_params", {"ignore_eos": 1}, "sampling_params.ignore_eos"),
    ("/abort_request", dict(), "abort_all", 1, "abort_all"),
    ("/update_weights_from_disk", dict(model_path="/nowhere"), "timeout", True, "timeout"),
    ("/update_weights_from_disk", dict(model_path="/nowhere"), "abort_all_requests", 1, "abort_all_requests"),
    ("/v1/load_lora_adapter", dict(lora_path="/nowhere"), "lora_name", 5, "lora_name"),
]


@pytest.mark.parametrize("path, body, field, value, param", MISTYPED)
def test_a_field_of_another_json_type_is_a_400_naming_it(tiny_dirs, tmp_path, path, body, field, value, param):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, enable_admin_api=True, admin_api_key="admin")
    r = http.post(path, json={**body, field: value}, headers={"Authorization": "Bearer admin"})  # admin routes too
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err
    assert not fake.prompts


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/chat/completions",
            {**CHAT, "logprobs": True, "top_logprobs": 2, "max_tokens": 5, "logit_bias": {"5": 1}},
        ),
        ("/v1/completions", {**COMPLETION, "logprobs": 2, "echo": False, "seed": 0, "max_tokens": 5, "min_p": 0}),
        ("/v1/responses", {**RESPONSE, "max_output_tokens": 5, "store": False}),
        ("/generate", dict(text="hi", sampling_params={"max_new_tokens": 5}, return_logprob=False)),
    ],
)
def test_values_of_the_right_json_type_pass_and_an_integer_is_a_number(front, path, body):
    http, fake, _ = front
    fake.reply = "ok"
    numbers = dict(temperature=1, top_p=1)  # JSON integers where numbers are asked
    r = post(
        http,
        path,
        **(
            {**body, "sampling_params": {**body["sampling_params"], **numbers}}
            if path == "/generate"
            else {**body, **numbers}
        ),
    )
    assert r.status_code == 200, r.text
    s = fake.samplings[-1]
    assert (s.temperature, s.top_p, s.max_tokens) == (1.0, 1.0, 5) and type(s.temperature) is float


class EchoHandle:
    """Test double of a request handle: the prompt's logprobs on the first event, then the reply's tokens."""

    request_id = "echo"

    def __init__(self, prompt: list[int], reply: list[int]):
        self.plps = [
            {"token_id": t, "logprob": -1.0 - k, "top": [[t, -1.0 - k]], "rank": 1} for k, t in enumerate(prompt[1:])
        ]
        self.reply = reply

    def events(self):
        for k, t in enumerate(self.reply):
            end = k == len(self.reply) - 1
            yield TokenEvent(
                self.request_id,
                t,
                {"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]},
                prompt_logprobs=None if k else self.plps,
                finish_reason="length" if end else "",
            )

    def cancel(self):
        pass


def streamed_choices(r) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                out.setdefault(ch["index"], []).append(ch)
    return out


def test_completions_echo_with_and_without_logprobs_streamed_or_not(front):
    http, fake, tok = front
    fake.reply = " there"
    r = post(http, "/v1/completions", model="m", prompt="hello", echo=True)
    assert r.json()["choices"][0]["text"] == "hello there" and fake.samplings[-1].prompt_logprobs is None
    post(http, "/v1/completions", model="m", prompt="hello", echo=True, logprobs=3, prompt_logprobs=1)
    assert fake.samplings[-1].prompt_logprobs == 3  # echo's logprobs need the prompt's
    got = streamed_choices(post(http, "/v1/completions", model="m", prompt="hello", echo=True, stream=True, n=2))
    assert {i: "".join(c["text"] for c in chs) for i, chs in got.items()} == {0: "hello there", 1: "hello there"}
    assert all(chs[0]["text"] == "hello" for chs in got.values())  # the prompt first
    ids, reply = tok.encode("hello"), tok.encode(" there", add_special_tokens=False)
    fake.reply = lambda sampling: EchoHandle(ids, reply)
    whole = post(http, "/v1/completions", model="m", prompt="hello", echo=True, logprobs=1).json()["choices"][0]
    (chs,) = streamed_choices(
        post(http, "/v1/completions", model="m", prompt="hello", echo=True, logprobs=1, stream=True)
    ).values()
    assert chs[0]["text"] == "hello" and chs[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chs) == whole["text"] == "hello there"
    for key in ("tokens", "token_logprobs"):
        assert [x for c in chs if c["logprobs"] for x in c["logprobs"][key]] == whole["logprobs"][key]
    assert len(whole["logprobs"]["tokens"]) == len(ids) + len(reply)
    r = post(http, "/v1/completions", model="m", prompt="hello", prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_neutral_values_of_those_fields_are_accepted(front):
    http, fake, _ = front
    fake.reply = "ok"
    assert post(http, "/v1/completions", model="m", prompt="hi", best_of=1, logit_bias={}).status_code == 200


def test_tokenize_agrees_with_the_tokenizer_and_the_chat_endpoint(front):
    http, fake, tok = front
    r = post(http, "/tokenize", model="m", prompt="Hello there")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": len(tok.encode("Hello there")),
        "max_model_len": 4096,
        "tokens": tok.encode("Hello there"),
    }
    fake.reply = "ok"
    post(http, "/v1/chat/completions", model="m", **ask())
    r = post(http, "/tokenize", **ask())  # the model field is optional, as in vLLM
    assert r.json()["tokens"] == fake.prompts[-1]  # exactly what the chat request was submitted as
    r = post(http, "/detokenize", tokens=tok.encode("Hello there"))
    assert r.json() == {"prompt": "Hello there"}


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/tokenize", dict(), 400),
        ("/tokenize", dict(prompt="a", messages=[{"role": "user", "content": "b"}]), 400),
        ("/tokenize", dict(model="other", prompt="a"), 404),
        ("/detokenize", dict(tokens=[-1]), 400),
        ("/detokenize", dict(tokens="abc"), 400),
    ],
)
def test_utility_endpoints_answer_bad_requests_with_openai_errors(front, path, body, status):
    http, _, _ = front
    r = post(http, path, **body)
    assert r.status_code == status and r.json()["error"]["message"], r.text


def test_utility_endpoints_need_the_key(tiny_dirs, tmp_path):
    http, _, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, api_key="k")
    assert post(http, "/tokenize", prompt="a").status_code == 401
    r = http.post("/tokenize", json={"prompt": "a", "tools": [WEATHER]}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200


def test_chat_rendering_options(front):
    """vLLM's add_generation_prompt, continue_final_message (the model continues a started reply) and
    chat_template_kwargs, on the chat endpoint and /tokenize alike."""
    http, fake, tok = front
    fake.reply = "ok"
    started = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}]

    def submitted(**extra):
        assert post(http, "/v1/chat/completions", model="m", **extra).status_code == 200
        ids = post(http, "/tokenize", **extra).json()["tokens"]
        assert ids == fake.prompts[-1]  # /tokenize renders as the chat endpoint does
        return tok.decode(ids, skip_special_tokens=False)

    assert submitted(messages=started).endswith("The capital is<|im_end|>\n<|im_start|>assistant\n")
    assert submitted(messages=started, add_generation_prompt=False).endswith("The capital is<|im_end|>\n")
    assert submitted(messages=started, continue_final_message=True).endswith("The capital is")
    assert submitted(messages=started, continue_final_message=True, add_generation_prompt=False).endswith(
        "The capital is"
    )


@pytest.mark.parametrize(
    "extra, words",
    [
        (dict(continue_final_message=True, add_generation_prompt=True), "cannot both be true"),
        (dict(chat_template_kwargs={"messages": []}), "messages cannot be set here"),
        (dict(continue_final_message=True, messages=[{"role": "user", "content": ""}]), "needs a final message"),
    ],
)
def test_chat_rendering_options_that_contradict_are_a_400(front, extra, words):
    http, fake, _ = front
    r = post(http, "/v1/chat/completions", model="m", **{"messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert not fake.prompts


def test_chat_template_kwargs_reach_the_template(tiny_dirs, tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    http, fake, tok = serve(tiny_dirs, tmp_path, template)
    fake.reply = "ok"
    for kwargs, end in ((None, "hi"), ({"shout": True}, "hi!")):
        r = post(
            http,
            "/v1/chat/completions",
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            chat_template_kwargs=kwargs,
        )
        assert r.status_code == 200 and tok.decode(fake.prompts[-1]) == end


def test_models_list_carries_the_context_length(front):
    """vLLM's extra field, which clients read to size prompts."""
    http, _, _ = front
    (model,) = http.get("/v1/models").json()["data"]
    assert model["id"] == "m" and model["max_model_len"] == 4096
    assert http.get("/v1/models/m").json() == model  # OpenAI's retrieve (client.models.retrieve)
    r = http.get("/v1/models/org/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_every_served_name_is_listed_and_taken_and_responses_name_the_first(tiny_dirs, tmp_path):
    """vLLM's ``--served-model-name a b``: requests may name either; responses name the first."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, model_aliases=("org/alias",))
    fake.reply = "ok"
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["m", "org/alias"]
    assert http.get("/v1/models/org/alias").json()["id"] == "org/alias"
    r = http.post("/v1/completions", json={"model": "org/alias", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "m"
    r = http.post("/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 404 and "'m' or 'org/alias'" in r.json()["error"]["message"]


def test_served_names_from_the_command_line_and_a_config_file(tmp_path):
    from argparse import Namespace

    from dualpath.serving.serve import served_names

    assert served_names(Namespace(served_model_name=["a", "b"]), str(tmp_path)) == ("a", "b")
    assert served_names(Namespace(served_model_name="a"), str(tmp_path)) == ("a",)  # YAML's one name
    assert served_names(Namespace(served_model_name=None), str(tmp_path / "ckpt")) == ("ckpt",)


def by_seed(sampling):
    return f"seed {sampling.seed}"


def test_n_choices_are_one_request_routed_by_choice(front):
    """n > 1: one submission carrying n (the engines sample choice i with seed + i from one prefill); its events
    are routed to their choices, choices in order, the prompt counted once in the usage and every choice's
    tokens."""
    http, fake, tok = front
    fake.reply = by_seed
    r = post(http, "/v1/completions", model="m", prompt="hi", n=3, seed=5)
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "seed 5"), (1, "seed 6"), (2, "seed 7")]
    assert len(fake.prompts) == 1 and fake.samplings[0].n == 3 and fake.samplings[0].seed == 5
    assert body["usage"]["prompt_tokens"] == len(fake.prompts[0])
    assert body["usage"]["completion_tokens"] == 3 * len(tok.encode("seed 5", add_special_tokens=False))
    assert http.front.in_flight == 0


def test_n_choices_stream_interleaved_and_the_openai_client_reads_them(front):
    http, fake, _ = front
    fake.reply = lambda sampling: CALL if sampling.seed == 1 else "plain"
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "stream": True, "n": 2, "seed": 0, "stream_options": {"include_usage": True}, **ask()},
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] += ch["delta"].get("content") or ""
            finish[ch["index"]] = ch["finish_reason"] or finish.get(ch["index"])
    assert text == {0: "plain", 1: ""} and finish == {0: "stop", 1: "tool_calls"}  # each choice its own
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and http.front.in_flight == 0
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    reply = client.chat.completions.create(model="m", n=2, seed=0, **ask())
    assert [c.finish_reason for c in reply.choices] == ["stop", "tool_calls"]
    assert reply.choices[1].message.tool_calls[0].function.name == "get_weather"


def test_a_request_that_cannot_start_fails_and_frees_every_choice_slot(front):
    http, fake, _ = front
    fake.reply = lambda sampling: DualPathError("scheduler gone") if sampling.seed == 2 else "fine"
    r = post(http, "/v1/completions", model="m", prompt="hi", n=3, seed=0)
    assert r.status_code == 503 and "scheduler gone" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1" and http.front.in_flight == 0


def test_n_is_bounded(front):
    http, fake, _ = front
    r = post(http, "/v1/completions", model="m", prompt="hi", n=17)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and not fake.prompts


class EndlessHandle:
    """Test double of a request handle: a token for each of ``n`` choices every few milliseconds until it is
    cancelled."""

    request_id = "endless"

    def __init__(self, n: int = 1):
        self.cancelled, self.n = threading.Event(), n

    def events(self):
        while not self.cancelled.wait(0.005):
            for i in range(self.n):
                yield TokenEvent(self.request_id, 104, index=i)

    def cancel(self):
        self.cancelled.set()


def test_a_non_streamed_request_whose_client_left_is_cancelled(front):
    http, fake, _ = front
    handles = []
    fake.reply = lambda sampling: handles.append(EndlessHandle(2)) or handles[-1]
    frontend = http.front

    class Gone:  # the request of a client that has hung up
        async def is_disconnected(self):
            return True

    async def collect():
        req = CompletionRequest.model_validate({"model": "m", "prompt": ["hi", "ho"], "n": 2})
        prompts = frontend.prompts.prompts(req, "completions")
        gens = await frontend.generations.start(req, prompts, [SamplingParams(max_tokens=10_000, n=2)] * 2)
        return await frontend.generations.gather(Gone(), gens)

    assert asyncio.run(collect()) is None  # the endpoint answers 499
    assert len(handles) == 2 and all(h.cancelled.is_set() for h in handles)  # both prompts' requests
    assert frontend.in_flight == 0


class PacedHandle:
    """Test double of a request handle: the choices' tokens interleaved, one every few milliseconds, each choice's
    last finishing it; nothing more once cancelled."""

    request_id = "paced"

    def __init__(self, choices: list[list[int]]):
        self.choices, self.cancels = choices, 0

    def events(self):
        left = len(self.choices)
        for step in range(max(map(len, self.choices))):
            for i, ids in enumerate(self.choices):
                if step >= len(ids):
                    continue
                if self.cancels or threading.Event().wait(0.005):
                    return
                end = step == len(ids) - 1
                left -= end
                yield TokenEvent(
                    self.request_id, ids[step], finish_reason="length" if end else "", index=i, final=end and not left
                )

    def cancel(self):
        self.cancels += 1


def test_a_choice_that_meets_its_stop_string_leaves_the_others_running(front):
    """A stop string ends its own choice only: the request is cancelled once, after the last choice is done."""
    http, fake, tok = front
    for stream in (False, True):
        handle = PacedHandle([tok.encode(t, add_special_tokens=False) for t in ("ab. cd", "efgh ij kl mn")])
        fake.reply = lambda sampling: handle
        r = post(http, "/v1/completions", model="m", prompt="hi", n=2, stop=["."], stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            texts, finish = ["", ""], [None, None]
            for c in chunks:
                for ch in c["choices"]:
                    texts[ch["index"]] += ch["text"]
                    finish[ch["index"]] = ch["finish_reason"] or finish[ch["index"]]
        else:
            texts = [c["text"] for c in r.json()["choices"]]
            finish = [c["finish_reason"] for c in r.json()["choices"]]
        assert texts == ["ab", "efgh ij kl mn"] and finish == ["stop", "length"]
        assert handle.cancels == 1 and http.front.in_flight == 0


def test_a_batch_of_prompts_is_one_request_each_with_choices_numbered_prompt_by_prompt(front):
    """OpenAI's batch form: choice ``p * n + i`` is prompt p's choice i; the usage counts every prompt once."""
    http, fake, tok = front
    fake.reply = by_seed
    r = post(http, "/v1/completions", model="m", prompt=["ab", "cd"], n=2, seed=5, echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "abseed 5"),
        (1, "abseed 6"),
        (2, "cdseed 5"),
        (3, "cdseed 6"),
    ]
    assert fake.prompts == [tok.encode("ab"), tok.encode("cd")] and all(s.n == 2 for s in fake.samplings)
    assert body["usage"]["prompt_tokens"] == len(tok.encode("ab")) + len(tok.encode("cd"))
    assert body["usage"]["completion_tokens"] == 4 * len(tok.encode("seed 5", add_special_tokens=False))
    streamed = [
        json.loads(x[6:])
        for x in post(
            http,
            "/v1/completions",
            model="m",
            prompt=[[5, 6], [7]],
            n=2,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        ).text.splitlines()
        if x.startswith("data: {")
    ]
    texts = {}
    for c in streamed:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {0: "seed 1", 1: "seed 2", 2: "seed 1", 3: "seed 2"} and streamed[-1]["usage"]["prompt_tokens"] == 3
    assert all("usage" not in c for c in streamed[:-1])
    running = [
        json.loads(x[6:])
        for x in post(  # vLLM's continuous_usage_stats: every chunk, the request's so far
            http,
            "/v1/completions",
            model="m",
            prompt=[[5, 6], [7]],
            n=2,
            seed=1,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ).text.splitlines()
        if x.startswith("data: {")
    ]
    so_far = [c["usage"]["completion_tokens"] for c in running]
    assert so_far == sorted(so_far) and so_far[-1] == streamed[-1]["usage"]["completion_tokens"] > so_far[0]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in running)
    for bad, n, param in ((["ok", ""], 1, "prompt"), (["x"] * 257, 1, "prompt"), (["x"] * 40, 16, "prompt")):
        r = post(http, "/v1/completions", model="m", prompt=bad, n=n)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.front.in_flight == 0


class RankedHandle:
    """Test double of a request handle: choice i's tokens each with log-probability ``means[i]``."""

    request_id = "ranked"

    def __init__(self, choices: list[list[int]], means: list[float]):
        self.choices, self.means = choices, means

    def events(self):
        for i, (ids, mean) in enumerate(zip(self.choices, self.means)):
            for k, t in enumerate(ids):
                end = k == len(ids) - 1
                yield TokenEvent(
                    self.request_id,
                    t,
                    {"token_id": t, "logprob": mean, "top": []},
                    index=i,
                    finish_reason="length" if end else "",
                    final=end and i == len(self.choices) - 1,
                )

    def cancel(self):
        pass


def test_best_of_returns_the_n_candidates_with_the_best_mean_logprob(front):
    """best_of candidates are sampled (with their tokens' logprobs, asked or not), the n with the highest mean
    logprob per token come back best first; the usage counts every candidate's tokens."""
    http, fake, tok = front
    texts = ["one one", "two", "three three three"]
    fake.reply = lambda sampling: RankedHandle(
        [tok.encode(t, add_special_tokens=False) for t in texts], [-1.0, -0.2, -0.5]
    )
    r = post(http, "/v1/completions", model="m", prompt="hi", n=2, best_of=3)
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [
        (0, "two", None),
        (1, "three three three", None),
    ]
    assert fake.samplings[-1].n == 3 and fake.samplings[-1].logprobs == 0
    assert body["usage"]["completion_tokens"] == sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    r = post(http, "/v1/completions", model="m", prompt="hi", best_of=3, logprobs=2)
    assert [c["text"] for c in r.json()["choices"]] == ["two"] and r.json()["choices"][0]["logprobs"]["tokens"]
    assert fake.samplings[-1].logprobs == 2 and http.front.in_flight == 0


def test_finished_requests_are_counted_by_reason_with_their_latency(front):
    http, fake, _ = front
    fake.reply = "four words of reply"
    post(http, "/v1/completions", model="m", prompt="hi", n=2)  # each choice counts
    post(http, "/v1/chat/completions", model="m", messages=[{"role": "user", "content": "hi"}])
    text = http.get("/metrics").text
    assert 'dualpath_requests_finished_total{finish_reason="stop"} 3.0' in text
    count = next(ln for ln in text.splitlines() if ln.startswith("dualpath_e2e_request_latency_seconds_count"))
    assert float(count.split()[-1]) == 3


def _serving(frontend, drain_s: float):
    """``frontend`` on a real socket (uvicorn, as ``dualpath serve`` runs it) in a thread; returns its URL, a
    function that stops it as SIGTERM would, and the thread."""
    from dualpath.serving.serve import _run, frontend_server

    server, sock = frontend_server(frontend.app, "127.0.0.1", 0, drain_s)
    loop, ready = asyncio.new_event_loop(), threading.Event()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(_run(server, sock, ready.set, stop, lambda: frontend.in_flight)),
        daemon=True,
    )
    thread.start()
    assert ready.wait(20)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", lambda: loop.call_soon_threadsafe(stop.set), thread


def test_a_stopping_server_finishes_requests_in_flight_and_refuses_new_ones(front):
    """SIGTERM (a rolling update, scancel) drains: a stream in flight runs to its end, new connections are
    refused; past --drain-timeout what still runs is cut and its request cancelled."""
    http, fake, tok = front
    ids = tok.encode("word " * 60, add_special_tokens=False)
    fake.reply = lambda sampling: PacedHandle([ids])
    url, stop, thread = _serving(http.front, drain_s=60)
    body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    lines = []
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 4:
                stop()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-2:] == ["data: [DONE]", ""] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    thread.join(20)
    assert not thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)

    handle = EndlessHandle()
    fake.reply = lambda sampling: handle
    url, stop, thread = _serving(http.front, drain_s=0.5)
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPError):
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    stop()
    thread.join(20)
    assert not thread.is_alive() and time.monotonic() - t0 < 10
    assert handle.cancelled.is_set() and http.front.in_flight == 0


def test_a_grammar_that_compiled_is_not_compiled_again(front, monkeypatch):
    """Agents send the same schemas and patterns again: the frontend checks each once (the last 256), and a bad
    one is a 400 every time."""
    from dualpath.serving import sampling

    http, fake, _ = front
    fake.reply = "yes"
    compiled = []
    real = sampling.structured.check
    monkeypatch.setattr(sampling.structured, "check", lambda c: compiled.append(c.source) or real(c))
    choices = [f"label {i}" for i in range(300)]
    for _ in range(3):
        assert post(http, "/v1/completions", model="m", prompt="hi", guided_choice=choices).status_code == 200
        assert post(http, "/v1/completions", model="m", prompt="hi", guided_regex="(a").status_code == 400
    assert len(compiled) == 4 and compiled.count("(a") == 3


def test_a_pump_whose_server_loop_has_closed_ends_quietly(monkeypatch):
    """A stopped server's event loop closes while a request's events may still come: the pump thread delivers to
    nobody and ends, instead of dying with "Event loop is closed"."""
    from dualpath.serving.choices import Fanout
    from test_tools import ScriptedHandle

    loop = asyncio.new_event_loop()
    loop.close()
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_value))
    Fanout(ScriptedHandle([[1, 2, 3]]), 1, loop)
    for t in [t for t in threading.enumerate() if t.name == "http-scripted"]:
        t.join(timeout=10)
    assert errors == []


def test_logprob_bytes_are_each_tokens_own_so_a_split_character_joins_whole(front):
    """OpenAI's ``bytes``: a character the tokenizer splits over tokens shows as a replacement character in each
    token's text, and is whole again when the tokens' bytes are joined."""
    http, _, tok = front
    ids = tok.encode("é🤖", add_special_tokens=False)
    assert len(ids) > 2  # byte-level BPE: the emoji's four bytes come in more than one token
    content = http.front.logprobs.chat([{"token_id": t, "logprob": -1.0, "top": ()} for t in ids])["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "é🤖"
    assert any(c["token"] == "\ufffd" for c in content)


def test_the_models_generation_config_fills_the_sampling_a_request_leaves_out(tiny_dirs, tmp_path):
    """vLLM's ``--generation-config``: the checkpoint's recommended temperature, top_p, top_k, min_p and
    repetition_penalty, and max_new_tokens as the default max_tokens, where a request does not set them; what a
    request sets wins; ``vllm`` turns them off; a directory without a usable file is a clear error."""
    from dualpath.core.errors import CheckpointError
    from dualpath.core.sampling_params import model_defaults
    from test_tools import HERMES_TEMPLATE, serve

    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 7,
                "eos_token_id": 2,
                "do_sample": True,
            }
        )
    )
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, generation_config=str(gen))
    fake.reply = "ok"
    messages = [{"role": "user", "content": "hi"}]
    assert post(http, "/v1/chat/completions", model="m", messages=messages).status_code == 200
    s = fake.samplings[-1]
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.min_p, s.max_tokens) == (
        0.6,
        0.95,
        20,
        1.05,
        0.0,
        7,
    )
    assert (
        post(http, "/v1/completions", model="m", prompt="hi", temperature=0, top_k=0, max_tokens=3).status_code == 200
    )
    s = fake.samplings[-1]
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.0, 0.95, 0, 3)
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "top_p": 0.5})
    assert (fake.samplings[-1].temperature, fake.samplings[-1].top_p) == (0.6, 0.5)
    assert (r.json()["temperature"], r.json()["top_p"]) == (0.6, 0.5)  # what the response ran with
    assert model_defaults("vllm", gen) == {} and model_defaults("auto", tmp_path) == {}
    assert model_defaults("auto", gen) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 7,
    }
    (gen / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(CheckpointError, match="unusable sampling defaults"):
        model_defaults(str(gen), "")
    with pytest.raises(CheckpointError, match="no generation_config.json"):
        model_defaults(str(tmp_path / "nowhere"), "")
