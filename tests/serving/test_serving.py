"""``dualpath serve`` end to end, through the real ``openai`` client and raw HTTP: answers, caching across turns,
streaming, equality with the single-process reference in every read-path mode, errors, schema conformance, and
client disconnects."""

import itertools
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families
from referencing import Registry, Resource

from dualpath import LLM, SamplingParams
from dualpath.core.structured import Constraint, choice_pattern
from grammar_check import accepts, read, schema
from serve_process import ServeProcess, alive

KEY = "test-key"
ADMIN_KEY = "test-admin-key"
BS = 16
MODES = ["pe", "de", "dualpath", "basic"]


def _openapi_nullable(node):
    """OpenAPI 3.0's ``nullable: true`` (still used in places in the published description) as JSON Schema."""
    if isinstance(node, dict):
        node = {k: _openapi_nullable(v) for k, v in node.items()}
        if node.pop("nullable", False):
            if "type" in node:
                node["type"] = [node["type"], "null"] if isinstance(node["type"], str) else node["type"] + ["null"]
            if "enum" in node:
                node["enum"] = node["enum"] + [None]
            if "$ref" in node:
                node = {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_openapi_nullable(v) for v in node]
    return node


SCHEMAS = _openapi_nullable(
    json.loads((Path(__file__).resolve().parents[1] / "data" / "openai_schemas.json").read_text())
)
REGISTRY = Registry().with_resource("urn:openai", Resource.opaque(SCHEMAS))


def validate(name: str, body) -> None:
    """Validate against the OpenAI API's published component schema ``name`` (raises on mismatch)."""
    Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=REGISTRY).validate(body)


def validate_completion_chunk(body) -> None:
    """Streamed completions share ``CreateCompletionResponse``, whose ``finish_reason`` the description does not
    let be null — but the API (and the ``openai`` client) send null until the last chunk. Check the chunk with
    exactly that one allowance."""
    if body["choices"] and body["choices"][0]["finish_reason"] is None:
        body = {**body, "choices": [{**body["choices"][0], "finish_reason": "length"}]}
    validate("CreateCompletionResponse", body)


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_adapters, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    server = ServeProcess(
        "--model",
        str(tiny_dirs["llama"]),
        "--block-size",
        str(BS),
        "--buffer-bytes",
        str(8 << 20),
        "--cache-bytes",
        str(32 << 20),
        "--workspace-tokens",
        "2048",
        "--kv-store",
        str(kv),
        "--lora-modules",
        *(f"{k}={p}" for k, p in tiny_adapters.items()),
        "--api-key",
        KEY,
        "--max-concurrent-requests",
        "3",
        "--max-body-bytes",
        str(1 << 20),
        "--enable-admin-api",
        "--admin-api-key",
        ADMIN_KEY,
        "--allowed-model-dirs",
        str(tmp_path_factory.getbasetemp()),
        "--max-model-len",
        "512",
        "--torch-threads",
        "1",
        "--health-generate-timeout",
        "2",
    )
    yield server
    children = server.children()
    assert server.stop() == 0, server.log_tail()
    time.sleep(0.5)
    assert not [p for p in children if alive(p)], "serve left processes behind"


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), block_size=BS)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def headers(key=KEY):
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


@pytest.mark.parametrize("mode", MODES)
def test_tiny_replies_equal_the_reference_in_every_mode(tiny, reference, mode):
    c = client(tiny)
    messages = [{"role": "user", "content": "hello there, how is the weather? " * 2}]
    for turn in range(2):
        r = c.chat.completions.create(
            model="llama",
            messages=messages,
            max_tokens=10,
            temperature=0,
            extra_body={"dualpath": {"mode": mode, "usage": True}},
        )
        ids = reference.tokenizer.apply_chat_template(messages)
        want = reference.generate(ids, SamplingParams(temperature=0, max_tokens=10))[0]
        assert r.choices[0].message.content == want.text
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.model_extra["dualpath"]["read_path"] in ("pe", "de")
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"tell me more, part {turn}"},
        ]
    prompt = f"The quick brown fox ({mode}) jumps over the lazy dog " * 3
    want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    for attempt in range(2):  # the second time, the prompt's blocks come from storage
        r = c.completions.create(
            model="llama", prompt=prompt, max_tokens=12, temperature=0, extra_body={"dualpath": {"mode": mode}}
        )
        assert r.choices[0].text == want.text
    assert r.usage.prompt_tokens_details.cached_tokens >= (len(reference.tokenizer.encode(prompt)) // BS - 1) * BS


def test_streaming_equals_non_streaming(tiny):
    c = client(tiny)
    messages = [{"role": "user", "content": "stream me something"}]
    full = c.chat.completions.create(model="llama", messages=messages, max_tokens=20, temperature=0)
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model="llama", messages=messages, max_tokens=20, temperature=0, stream=True)
        if ch.choices
    ]
    assert "".join(parts) == full.choices[0].message.content
    text = c.completions.create(model="llama", prompt="abc", max_tokens=15, temperature=0).choices[0].text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model="llama", prompt="abc", max_tokens=15, temperature=0, stream=True)
    )
    assert streamed == text


def test_stop_strings_seed_and_logprobs(tiny, reference):
    c = client(tiny)
    base = c.completions.create(model="llama", prompt="0123456789", max_tokens=12, temperature=0).choices[0].text
    stop = base[4:6]
    r = c.completions.create(model="llama", prompt="0123456789", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"
    a = c.completions.create(model="llama", prompt="seeded", max_tokens=8, temperature=1.0, seed=42).choices[0].text
    b = c.completions.create(model="llama", prompt="seeded", max_tokens=8, temperature=1.0, seed=42).choices[0].text
    assert a == b
    r = c.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    lps = r.choices[0].logprobs.content
    assert len(lps) == 4 and all(len(t.top_logprobs) == 3 for t in lps)
    assert all(t.logprob <= 0 and abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in lps)  # greedy


def test_a_responses_conversation_equals_the_reference_and_its_second_turn_loads_the_first(tiny, reference):
    """/v1/responses through the cluster: each turn's text is the reference's for the chat the items describe, the
    logprobs are the tokens', and a turn continued by previous_response_id finds the first turn's KV stored."""
    c = client(tiny)
    first_input = "hello there, what do you know about the weather today? " * 2
    r1 = c.responses.create(
        model="llama",
        input=first_input,
        max_output_tokens=8,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    messages = [{"role": "user", "content": first_input}]
    want = reference.generate(
        reference.tokenizer.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=8)
    )[0]
    assert r1.output_text == want.text and r1.usage.output_tokens == len(want.token_ids)
    lps = r1.output[0].content[0].logprobs
    assert len(lps) == len(want.token_ids) and all(len(t.top_logprobs) == 2 for t in lps)
    r2 = c.responses.create(
        model="llama", input="and tomorrow?", previous_response_id=r1.id, max_output_tokens=8, temperature=0
    )
    messages += [{"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "and tomorrow?"}]
    ids = reference.tokenizer.apply_chat_template(messages)
    assert r2.output_text == reference.generate(ids, SamplingParams(temperature=0, max_tokens=8))[0].text
    assert r2.usage.input_tokens == len(ids) and r2.usage.input_tokens_details.cached_tokens >= BS
    details = r2.usage.input_tokens_details
    assert details.cache_write_tokens == len(ids) // BS * BS - details.cached_tokens  # the full blocks not loaded
    validate("Response", r2.model_dump(mode="json", exclude_unset=True))


def test_a_cache_salt_keeps_a_tenants_stored_kv_its_own(tiny, reference):
    """vLLM's cache_salt on chats and responses: the same conversation hits storage under its own salt only, and
    the replies are the unsalted reference's."""
    c = client(tiny)
    messages = [{"role": "user", "content": "a private question about the weather, asked twice " * 2}]
    want = reference.generate(
        reference.tokenizer.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=6)
    )[0].text

    def cached(salt: str) -> int:
        r = c.chat.completions.create(
            model="llama", messages=messages, max_tokens=6, temperature=0, extra_body={"cache_salt": salt}
        )
        assert r.choices[0].message.content == want
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached("tenant-a"), cached("tenant-b")] == [0, 0]
    assert cached("tenant-a") >= BS
    r1 = c.responses.create(
        model="llama",
        input="salted turns " * 4,
        max_output_tokens=4,
        temperature=0,
        extra_body={"cache_salt": "tenant-c"},
    )
    assert r1.usage.input_tokens_details.cached_tokens == 0
    again = [
        c.responses.create(
            model="llama",
            input="and then?",
            previous_response_id=r1.id,
            max_output_tokens=4,
            temperature=0,
            extra_body=extra,
        ).usage.input_tokens_details.cached_tokens
        for extra in ({"cache_salt": "tenant-d"}, {"cache_salt": "tenant-c"})
    ]
    assert again[0] == 0 and again[1] >= BS


def test_lora_adapters_are_served_as_models_with_stored_kv_of_their_own(tiny, reference, tiny_adapters):
    """``--lora-modules``: each adapter is a model of its own (listed with its parent; replies name it) whose replies
    are the reference's under that adapter, decoded beside the base model; its turns hit only the KV its own
    turns stored, so the base model and the other adapter never load KV computed with other weights."""
    c = client(tiny)
    cards = {m.id: m for m in c.models.list().data}
    assert (
        cards["sql"].model_extra["parent"] == "llama"
        and cards["sql"].model_extra["root"] == str(tiny_adapters["sql"])
        and cards["llama"].model_extra["parent"] is None
    )
    messages = [{"role": "user", "content": "one question for three models, asked more than once " * 2}]
    ids = reference.tokenizer.apply_chat_template(messages)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {
        m: reference.generate(ids, greedy, lora_request=str(tiny_adapters[m]) if m != "llama" else None)[0].text
        for m in ("llama", "sql", "poet")
    }
    assert len(set(want.values())) == 3

    def ask(model: str):
        r = c.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.model == model and r.choices[0].message.content == want[model], model
        return r.usage.prompt_tokens_details.cached_tokens

    first = {m: ask(m) for m in ("sql", "llama", "poet")}
    assert first == {"sql": 0, "llama": 0, "poet": 0}  # the prompt's KV differs under each: no one's hit
    assert ask("poet") >= BS and ask("sql") >= BS
    with c.chat.completions.create(
        model="sql", messages=messages, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        chunks = list(stream)
    assert {ch.model for ch in chunks} == {"sql"}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want["sql"]
    r = c.responses.create(
        model="poet", input=messages[0]["content"], max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.model == "poet" and r.output_text == want["poet"]
    with pytest.raises(openai.NotFoundError, match="'sql' or 'poet'"):
        c.completions.create(model="sq1", prompt="hi", max_tokens=2)


def test_a_lora_adapter_loaded_at_runtime_is_served_until_unloaded(tiny, reference, tiny_dirs, tmp_path):
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (SGLang's paths too): every engine loads it,
    requests then name it and get the reference's reply under it; a name in use or an adapter that cannot be served
    is a 400 and changes nothing; once unloaded the name is unknown again."""
    from dualpath.checkpoints.tiny import build_tiny_adapter

    chef = str(build_tiny_adapter(tmp_path / "chef", tiny_dirs["llama"], seed=9, targets=("o_proj", "down_proj")))
    dora = shutil.copytree(chef, tmp_path / "dora")
    (dora / "adapter_config.json").write_text(
        json.dumps({**json.loads((dora / "adapter_config.json").read_text()), "use_dora": True})
    )
    c, prompt = client(tiny), "a dish for the runtime adapter " * 2
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="chef", prompt=prompt, max_tokens=4)
    admin = headers(ADMIN_KEY)
    assert raw(tiny, "/v1/load_lora_adapter", {"lora_name": "chef", "lora_path": chef}).status_code == 403  # KEY's
    bad = [
        raw(tiny, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": chef}, hdrs=admin),
        raw(tiny, "/load_lora_adapter", {"lora_name": "chef2", "lora_path": str(dora)}, hdrs=admin),
        raw(tiny, "/v1/load_lora_adapter", {"lora_name": "chef3", "lora_path": str(tmp_path / "none")}, hdrs=admin),
        raw(tiny, "/v1/load_lora_adapter", {"lora_name": "chef4", "lora_path": "/etc"}, hdrs=admin),
    ]
    assert [(r.status_code, r.json()["error"]["param"]) for r in bad] == [
        (400, "lora_name"),
        (400, "lora_path"),
        (400, "lora_path"),
        (400, "lora_path"),
    ], [r.text for r in bad]
    assert "--allowed-model-dirs" in bad[-1].json()["error"]["message"]
    r = raw(tiny, "/v1/load_lora_adapter", {"lora_name": "chef", "lora_path": chef}, hdrs=admin)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert c.models.retrieve("chef").model_extra["root"] == chef
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = reference.generate(reference.tokenizer.encode(prompt), greedy, lora_request=chef)[0].text
    assert want != reference.generate(reference.tokenizer.encode(prompt), greedy)[0].text
    got = c.completions.create(
        model="chef", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want and got.model == "chef"
    assert raw(tiny, "/unload_lora_adapter", {"lora_name": "chef"}, hdrs=admin).status_code == 200
    assert raw(tiny, "/v1/unload_lora_adapter", {"lora_name": "chef"}, hdrs=admin).status_code == 404
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="chef", prompt=prompt, max_tokens=4)


@pytest.mark.parametrize("mode", ["pe", "de"])
def test_json_mode_through_the_cluster_equals_the_reference(tiny, reference, mode):
    """The prefill engine masks the first token, the decode engine replays it into its guide and masks the rest:
    the same tokens as one process, a JSON object when the reply stops (the tiny model: one token per byte)."""
    c = client(tiny)
    messages = [{"role": "user", "content": f"answer in JSON ({mode})"}]
    ids = reference.tokenizer.apply_chat_template(messages)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    formats = (
        ({"type": "json_object"}, dict(json_object=True)),
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}, dict(json_schema=json.dumps(schema))),
    )
    for (fmt, structured), (temperature, seed) in itertools.product(formats, ((0, None), (1.0, 7))):
        want = reference.generate(
            ids, SamplingParams(temperature=temperature, seed=seed, max_tokens=120, **structured)
        )[0]
        r = c.chat.completions.create(
            model="llama",
            messages=messages,
            max_tokens=120,
            temperature=temperature,
            seed=seed,
            response_format=fmt,
            extra_body={"dualpath": {"mode": mode}},
        )
        got = r.choices[0]
        assert got.message.content == want.text and got.finish_reason == want.finish_reason
        assert want.text.lstrip().startswith("{")
        if got.finish_reason == "stop":
            reply = json.loads(got.message.content)
            assert isinstance(reply, dict) and (fmt["type"] == "json_object" or set(reply) == {"n", "ok"})
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="llama",
            messages=messages,
            max_tokens=120,
            temperature=0,
            response_format={"type": "json_object"},
            stream=True,
        )
        if ch.choices
    )
    assert streamed == reference.generate(ids, SamplingParams(temperature=0, max_tokens=120, json_object=True))[0].text


def test_patterns_and_choices_through_the_cluster_equal_the_reference(tiny, reference):
    """guided_regex, guided_choice, guided_grammar and a structural tag on both read paths: the prefill engine's
    first token may already be the end token's turn (a choice of one character), the start of a match the decode
    engine ends with the end token, or free text in which the decode engine meets the trigger."""
    c = client(tiny)
    messages = [{"role": "user", "content": "pick one"}]
    ids = reference.tokenizer.apply_chat_template(messages)
    choices, grammar = ["y", "yes", "no"], 'root ::= ("y" | "n") item*\nitem ::= "," [0-9]'
    number = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "triggers": ["@"],
        "structures": [{"begin": "@a", "schema": number, "end": "!"}, {"begin": "@b", "schema": number, "end": "!"}],
    }
    tagged = dict(
        json_schema=json.dumps({"anyOf": [number, number]}),
        json_prefix="@",
        json_suffix="!",
        json_branches=("a", "b"),
        json_trigger=True,
    )
    bias = {"logit_bias": {str(ord("@")): 3.0}}  # the tiny tokenizer: a token a byte
    tag_grammar = schema({"anyOf": [number, number]}, "@", "!", trigger=True, branches=("a", "b"))
    asks = (
        (dict(guided_regex=r"\d+"), dict(regex=r"\d+"), lambda t: re.fullmatch(r"\d+", t, re.ASCII)),
        (dict(guided_choice=choices), dict(regex=choice_pattern(choices)), lambda t: t in choices),
        (dict(guided_grammar=grammar), dict(grammar=grammar), lambda t: accepts(Constraint("grammar", grammar), t)),
        (
            dict(response_format=tag, **bias),
            dict(tagged, logit_bias=((ord("@"), 3.0),)),
            lambda t: read(tag_grammar, t) is not None and "@" in t,
        ),
    )
    for mode, ((extra, params, valid), seed) in itertools.product(("pe", "de"), itertools.product(asks, (1, 5))):
        want = reference.generate(ids, SamplingParams(temperature=1.0, seed=seed, max_tokens=40, **params))[0]
        got = c.chat.completions.create(
            model="llama",
            messages=messages,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            extra_body={**extra, "dualpath": {"mode": mode}},
        ).choices[0]
        assert got.message.content == want.text and got.finish_reason == want.finish_reason, (mode, extra)
        assert valid(got.message.content) and (got.finish_reason == "stop" or "json_trigger" in params)


@pytest.mark.parametrize("mode", ["pe", "de"])
def test_penalties_through_the_cluster_equal_the_reference(tiny, reference, mode):
    """The prefill engine's first token sees the prompt's repetition penalty and min_tokens; the decode engine
    continues with the first token counted: the same tokens as one process, greedy and seeded with min_p; and
    allowed_token_ids on both engines."""
    c = client(tiny)
    prompt = f"again and again and again ({mode}) " * 3
    ids = reference.tokenizer.encode(prompt)
    eos = reference.model_config.eos_token_ids
    knobs = dict(presence_penalty=0.6, frequency_penalty=0.3, logit_bias={str(eos[0]): 5.0} if eos else {"1": 5.0})
    extra = dict(repetition_penalty=1.4, min_tokens=5)
    for temperature, seed, min_p in ((0, None, 0.0), (1.0, 11, 0.05)):
        want = reference.generate(
            ids,
            SamplingParams(
                temperature=temperature,
                seed=seed,
                max_tokens=16,
                min_p=min_p,
                **extra,
                presence_penalty=0.6,
                frequency_penalty=0.3,
                logit_bias=tuple((int(k), v) for k, v in knobs["logit_bias"].items()),
            ),
        )[0]
        r = c.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=16,
            temperature=temperature,
            seed=seed,
            **knobs,
            extra_body={"dualpath": {"mode": mode}, "min_p": min_p, **extra},
        )
        assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids) >= 5
    allowed = tuple(reference.tokenizer.encode("abc xyz"))
    want = reference.generate(ids, SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed))[0]
    r = c.completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"dualpath": {"mode": mode}, "allowed_token_ids": list(allowed)},
    )
    assert r.choices[0].text == want.text and set(want.token_ids) <= set(allowed)


def test_prompt_logprobs_and_echo_through_the_cluster_equal_the_reference(tiny, reference):
    """A prompt whose blocks are stored is computed whole when its logprobs are asked (no hit), on the prefill
    engine, chunk by chunk; the numbers reach the response in vLLM's form and in echo's (OpenAI's legacy form)."""
    prompt = "the same words, stored once already, then scored " * 3
    ids = reference.tokenizer.encode(prompt)
    c = client(tiny)
    c.completions.create(model="llama", prompt=prompt, max_tokens=2, temperature=0)  # its blocks stored
    want = reference.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    r = raw(
        tiny,
        "/v1/completions",
        {
            "model": "llama",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 2,
            "dualpath": {"usage": True},
        },
    ).json()
    assert "choices" in r, r  # the decode engine's steps add nothing to them (nor fail on them)
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for tid, entry, lp in zip(ids[1:], got[1:], want.prompt_logprobs[1:]):
        assert abs(entry[str(tid)]["logprob"] - lp.logprob) < 1e-4 and entry[str(tid)]["rank"] == lp.rank
        assert {int(t) for t in entry} == {tid, *[t for t, _ in lp.top]}
    r = raw(
        tiny,
        "/v1/completions",
        {"model": "llama", "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1},
    ).json()["choices"][0]
    assert r["text"] == prompt + want.text
    lps = r["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None and len(lps["tokens"]) == len(ids) + 2
    assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(lps["token_logprobs"][1 : len(ids)], want.prompt_logprobs[1:]))
    with httpx.Client(timeout=60) as h:  # streamed: the prompt's chunk (with its logprobs) first, then the reply's
        body = {
            "model": "llama",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "echo": True,
            "logprobs": 1,
            "stream": True,
        }
        lines = h.post(tiny.url + "/v1/completions", headers=headers(), json=body).text.splitlines()
    chunks = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
    assert chunks[0]["text"] == prompt and "".join(c["text"] for c in chunks) == r["text"]
    for key in ("token_logprobs", "text_offset"):  # the stream's offsets run on across its chunks
        assert [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]] == lps[key], key
    assert lps["text_offset"][len(ids)] == len(prompt)  # the reply's tokens begin after the echoed prompt
    named = raw(
        tiny,
        "/v1/completions",
        {
            "model": "llama",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "echo": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    named = named["choices"][0]["logprobs"]  # vLLM's names for tokens, where text cannot tell them apart
    assert named["tokens"] == [f"token_id:{t}" for t in ids + want.token_ids]
    assert named["text_offset"] == lps["text_offset"] and named["token_logprobs"] == lps["token_logprobs"]
    assert all(k.startswith("token_id:") for top in named["top_logprobs"][1:] for k in top)
    chat = raw(
        tiny,
        "/v1/chat/completions",
        {
            "model": "llama",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 0,
            "logprobs": True,
            "top_logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    # each token's own bytes: joined, they are the reply's text (a character split across tokens whole again)
    joined = bytes(b for c in content for b in c["bytes"]).decode(errors="replace")
    assert joined == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("mode", ["pe", "de"])
def test_n_choices_share_one_prompt_load_and_equal_the_reference(tiny, reference, mode):
    """n choices are one request: the prompt's stored KV is loaded once (the bytes of one choice), the decode
    engine forks the choices off its blocks, and choice i gives what one process gives with seed + i — also when
    choices end at different steps (an early one's end is streamed before the others')."""
    c = client(tiny)
    prompt = f"Parallel sampling ({mode}) shares the prompt's blocks between choices " * 3
    ids = reference.tokenizer.encode(prompt)
    body = dict(model="llama", prompt=prompt, max_tokens=10, temperature=1.0, seed=11)
    extra = {"dualpath": {"mode": mode, "usage": True}}
    for _ in range(2):  # the second time its blocks come from storage
        one = c.completions.create(**body, extra_body=extra)
    want = [reference.generate(ids, SamplingParams(temperature=1.0, max_tokens=10, seed=11 + i))[0] for i in range(3)]
    r = c.completions.create(**body, n=3, extra_body=extra)
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    loaded = one.usage.model_extra["dualpath"]["kv_bytes_loaded"]
    assert loaded > 0 and r.usage.model_extra["dualpath"]["kv_bytes_loaded"] == loaded
    assert r.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens_details.cached_tokens > 0
    vocab = reference.tokenizer.vocab_size  # the tiny model's logits are wider than its tokenizer
    stop = [next(t for t in want[0].token_ids[1:] if t < vocab)]  # choice 0 ends early, the others later or not
    want = [
        reference.generate(ids, SamplingParams(temperature=1.0, max_tokens=10, seed=11 + i, stop_token_ids=stop))[0]
        for i in range(3)
    ]
    chunks = list(c.completions.create(**body, n=3, stream=True, extra_body={**extra, "stop_token_ids": stop}))
    texts, finish = ["", "", ""], [None] * 3
    for ch in chunks:
        for x in ch.choices:
            texts[x.index] += x.text
            finish[x.index] = x.finish_reason or finish[x.index]
    assert texts == [w.text for w in want] and finish == [w.finish_reason for w in want]
    cands = [
        reference.generate(ids, SamplingParams(temperature=1.0, max_tokens=10, seed=11 + i, logprobs=0))[0]
        for i in range(3)
    ]
    best = max(cands, key=lambda o: sum(lp.logprob for lp in o.logprobs) / len(o.logprobs))
    r = c.completions.create(**body, best_of=3, extra_body=extra)  # the best of 3 by mean logprob
    assert [ch.text for ch in r.choices] == [best.text] and r.usage.completion_tokens == 30


def test_a_batch_of_prompts_is_scored_and_sampled_prompt_by_prompt(tiny, reference):
    """Completions' batch form, as evaluation harnesses send it: echo with logprobs over several prompts at once
    (each prompt's tokens scored), and seeded replies to each prompt equal to the single-process reference (this
    server admits 3 generations at once: n x prompts beyond that is a 400)."""
    prompts = ["the first prompt of a batch", "and a second, longer prompt of the same batch " * 2]
    r = raw(
        tiny,
        "/v1/completions",
        {"model": "llama", "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1},
    ).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for p, choice in zip(prompts, r["choices"]):
        ids = reference.tokenizer.encode(p)
        want = reference.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        got = choice["logprobs"]["token_logprobs"]
        assert choice["text"] == p + want.text and len(got) == len(ids) + 1 and got[0] is None
        assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(got[1 : len(ids)], want.prompt_logprobs[1:]))
    r = client(tiny).completions.create(model="llama", prompt=prompts, max_tokens=6, temperature=1.0, seed=9)
    want = [reference.generate(p, SamplingParams(temperature=1.0, max_tokens=6, seed=9))[0].text for p in prompts]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert r.usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in prompts)


def raw(server, path, body=None, method="POST", hdrs=None):
    h = headers() if hdrs is None else hdrs
    with httpx.Client(timeout=60) as h_:
        if method == "GET":
            return h_.get(server.url + path, headers=h)
        return h_.post(
            server.url + path, headers=h, content=body if isinstance(body, (bytes, str)) else json.dumps(body)
        )


def test_error_cases_return_openai_errors_and_the_server_keeps_serving(tiny):
    cases = [
        (dict(body=b"{not json"), 400, None),
        (
            dict(body={"model": "llama", "messages": [{"role": "user", "content": "x"}], "temperature": 5}),
            400,
            "temperature",
        ),
        (dict(body={"model": "llama"}), 400, "messages"),
        (
            dict(body={"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            400,
            "max_tokens",
        ),
        (dict(body={"model": "llama", "messages": [{"role": "user", "content": "x" * 600}]}), 400, "messages"),
        (
            dict(body={"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 600}),
            400,
            "max_tokens",
        ),
        (dict(body={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
        (
            dict(
                body={"model": "llama", "messages": [{"role": "user", "content": "x"}]},
                hdrs={"Content-Type": "application/json"},
            ),
            401,
            None,
        ),
        (
            dict(
                body={"model": "llama", "messages": [{"role": "user", "content": "x"}]},
                hdrs={"Authorization": "Bearer wrong", "Content-Type": "application/json"},
            ),
            401,
            None,
        ),
        (
            dict(
                body={"model": "llama", "messages": [{"role": "user", "content": "x"}]},
                hdrs={**headers(), "Content-Type": "text/plain"},
            ),
            415,
            None,
        ),  # a form a web page could post
        (dict(body=b"{" + b" " * (2 << 20) + b"}"), 413, None),
        (dict(body={"model": "llama", "prompt": ["a", "b", "c", "d"]}, path="/v1/completions"), 400, "prompt"),
        (dict(body={"model": "llama", "prompt": "a", "n": 4}, path="/v1/completions"), 400, "n"),
        (dict(body={"model": "llama", "prompt": "a", "cache_salt": ""}, path="/v1/completions"), 400, "cache_salt"),
        (
            dict(body={"model": "llama", "input": "a", "cache_salt": "s" * 1025}, path="/v1/responses"),
            400,
            "cache_salt",
        ),
        (
            dict(body={"model": "llama", "prompt": "a", "priority": 1}, path="/v1/completions"),
            400,
            "priority",
        ),  # fcfs: the scheduler's refusal names the field
        (dict(body={"text": "a", "priority": 1}, path="/generate"), 400, "priority"),
        (dict(body={"model": "llama", "prompt": "a", "priority": 2**31}, path="/v1/completions"), 400, "priority"),
    ]
    for kw, status, param in cases:
        r = raw(tiny, kw.pop("path", "/v1/chat/completions"), kw["body"], hdrs=kw.get("hdrs"))
        assert r.status_code == status, (kw, r.text)
        body = r.json()
        validate("ErrorResponse", body)
        if param:
            assert body["error"]["param"] == param, body
    r = raw(tiny, "/v1/nowhere", {})
    assert r.status_code == 404 and "error" in r.json()
    ok = client(tiny).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "still there?"}], max_tokens=3, temperature=0
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_overload_beyond_the_bounded_queue_gets_429_with_retry_after(tiny):
    results = []

    def long_request():
        r = raw(tiny, "/v1/completions", {"model": "llama", "prompt": "go", "max_tokens": 400, "temperature": 0})
        results.append((r.status_code, r.headers.get("retry-after")))

    threads = [threading.Thread(target=long_request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = [c for c, _ in results]
    assert codes.count(200) >= 1 and 429 in codes, codes
    assert all(ra == "1" for c, ra in results if c == 429)


def test_responses_conform_to_the_openai_schemas(tiny):
    validate("ListModelsResponse", raw(tiny, "/v1/models", method="GET").json())
    chat = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "dualpath": {"usage": True},
    }
    validate("CreateChatCompletionResponse", raw(tiny, "/v1/chat/completions", chat).json())
    comp = {"model": "llama", "prompt": "hi", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    validate("CreateCompletionResponse", raw(tiny, "/v1/completions", comp).json())
    for path, body, check in (
        ("/v1/chat/completions", chat, lambda b: validate("CreateChatCompletionStreamResponse", b)),
        ("/v1/completions", comp, validate_completion_chunk),
    ):
        lines = raw(tiny, path, {**body, "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "[DONE]" and len(data) > 2
        for d in data[:-1]:
            check(json.loads(d))


def metric(server, name, path="/metrics") -> float:
    for line in raw(server, path, method="GET").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.split()[-1])
    return 0.0


def test_one_api_metrics_scrape_holds_the_scheduler_engine_and_kv_series_and_start_up_was_reported(tiny):
    """The API port's /metrics pulls the scheduler's series (its engines', KV cache's, transport's) at each scrape;
    ``serve`` printed each engine as it started and as it was ready, with its KV cache size."""
    client(tiny).completions.create(model="llama", prompt="count: one two three", max_tokens=2, temperature=0)
    text = raw(tiny, "/metrics", method="GET").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "dualpath_completion_tokens",
        "dualpath_scheduler_submitted",
        "dualpath_engine_kv_cache_usage",
        "dualpath_engine_kv_cache_tokens",
        "dualpath_storage_used_bytes",
        "dualpath_engine_kv_bytes",
    } <= names
    assert metric(tiny, "dualpath_scheduler_up") == 1 and metric(tiny, "dualpath_scheduler_submitted_total") >= 1
    assert re.search(r'dualpath_engine_kv_cache_tokens\{engine="decode-0",role="decode"\} [1-9]', text)
    log = tiny.log.read_text()
    for engine in ("prefill-0", "decode-0"):
        assert f"starting {engine} (llama on cpu)" in log
        assert re.search(rf"{engine} \(llama on cpu\) ready after [0-9.]+ s, KV cache [0-9,]+ tokens", log), log


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "go on", "max_tokens": 400}),
        ("/v1/responses", {"input": "go on", "max_output_tokens": 400}),
    ],
)
def test_a_client_that_disconnects_mid_stream_frees_its_request(tiny, path, body):
    before = metric(tiny, "dualpath_requests_cancelled_total")
    body = {"model": "llama", "temperature": 0, "stream": True, **body}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", tiny.url + path, headers=headers(), json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            metric(tiny, "dualpath_requests_cancelled_total") > before
            and metric(tiny, "dualpath_requests_in_flight") == 0
        ):
            break
        time.sleep(0.2)
    assert metric(tiny, "dualpath_requests_cancelled_total") > before
    assert metric(tiny, "dualpath_requests_in_flight") == 0
    health = raw(tiny, "/health", method="GET")
    assert health.status_code == 200


def engines_of(server, role: str) -> list[int]:
    return [pid for pid in server.children() if f"--role\0{role}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_health_generate_runs_a_token_through_the_cluster_and_tells_a_wedged_engine(tiny, tiny_dirs):
    """/health stays 200 while the prefill engine's process is stopped (it is still registered: a wedged loop
    looks like that); /health_generate is 503 within its 2 s, and 200 again once the engine runs."""
    before = metric(tiny, "dualpath_prompt_tokens_total")
    assert raw(tiny, "/health_generate", method="GET").status_code == 200
    assert metric(tiny, "dualpath_prompt_tokens_total") == before  # a probe is not usage
    info = raw(tiny, "/get_model_info", method="GET").json()
    assert info["model_path"] == str(tiny_dirs["llama"]) and info["model_type"] == "llama"
    assert raw(tiny, "/version", method="GET").json()["version"]
    prefill = engines_of(tiny, "prefill")
    assert prefill
    for pid in prefill:
        os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        probe = raw(tiny, "/health_generate", method="GET")
        waited = time.monotonic() - start
        assert raw(tiny, "/health", method="GET").status_code == 200
    finally:
        for pid in prefill:
            os.kill(pid, signal.SIGCONT)
    assert probe.status_code == 503 and "no token within 2 s" in probe.json()["error"] and 1.5 < waited < 8
    deadline = time.monotonic() + 30
    while raw(tiny, "/health_generate", method="GET").status_code != 200:
        assert time.monotonic() < deadline, "the cluster did not answer the probe again"
    assert raw(tiny, "/v1/completions", {"model": "llama", "prompt": "again", "max_tokens": 4}).status_code == 200


@pytest.fixture(scope="module")
def default_model(smollm2_dir, tmp_path_factory):
    server = ServeProcess("--kv-store", str(tmp_path_factory.mktemp("kv")))
    yield server
    assert server.stop() == 0, server.log_tail()


def test_default_model_answers_and_caches_across_turns(default_model):
    c = openai.OpenAI(base_url=f"{default_model.url}/v1", api_key="none", max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    system = (
        "You are a concise geography assistant. Answer in one short sentence. "
        "Never add commentary, lists or follow-up questions. "
    ) * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    r1 = c.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    assert "Paris" in r1.choices[0].message.content
    full_blocks = r1.usage.prompt_tokens // 64 * 64
    assert full_blocks >= 64
    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And the capital of Germany?"},
    ]
    r2 = c.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= full_blocks
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0, stream=True)
        if ch.choices
    )
    assert streamed == r2.choices[0].message.content
    # the KV store is capped by default (half the disk's free space), and its use is reported
    scheduler = re.search(r"scheduler metrics at (\S+)/metrics", default_model.log.read_text()).group(1)
    deadline, used, cap = time.monotonic() + 15, 0.0, 0.0
    while time.monotonic() < deadline and not used:
        text = httpx.get(f"{scheduler}/metrics", timeout=10).text
        used = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("dualpath_storage_used_bytes{"))
        cap = max(
            float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("dualpath_storage_capacity_bytes{")
        )
        time.sleep(0.2)
    assert used >= full_blocks * 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 3 KV heads of 64, float32
    assert 0 < cap and abs(cap - (shutil.disk_usage(default_model.dir).free + used) / 2) < 0.02 * cap
