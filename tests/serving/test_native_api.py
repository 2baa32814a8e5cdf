"""SGLang's native ``/generate`` on the frontend (against a test double of the cluster; the tiny tokenizer is one
token per byte): its fields become the engines' sampling, its answers SGLang's shape, its errors 400s naming its
own fields. The real cluster's answers (logprobs included) are checked in ``test_weight_updates.py``."""

import json

import pytest

from test_tools import HERMES_TEMPLATE, serve


@pytest.fixture
def front(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = "Sunny, 21 C."
    return http, fake, tok


def test_one_prompt_gives_one_object(front):
    http, fake, tok = front
    out = http.post("/generate", json={"text": "Weather?", "sampling_params": {"max_new_tokens": 40}}).json()
    ids = tok.encode("Sunny, 21 C.", add_special_tokens=False)
    assert out["text"] == "Sunny, 21 C." and out["output_ids"] == ids
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": ids[-1]}
    assert meta["prompt_tokens"] == len(tok.encode("Weather?")) and meta["completion_tokens"] == len(ids)
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0 and "output_token_logprobs" not in meta
    assert fake.prompts[-1] == tok.encode("Weather?") and fake.samplings[-1].max_tokens == 40


def test_sampling_params_reach_the_engines_under_their_own_names(front):
    http, fake, _ = front
    sp = {
        "max_new_tokens": 30,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.1,
        "stop": ["\n\n"],
        "stop_token_ids": [7],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 11,
        "logit_bias": {"5": -2.0},
        "spaces_between_special_tokens": True,
    }
    assert http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": sp}).status_code == 200
    s = fake.samplings[-1]
    assert (s.max_tokens, s.min_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (30, 2, 0.7, 0.9, 0, 0.05)
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.1, 0.2, 1.1)
    assert s.stop == ("\n\n",) and s.stop_token_ids == (7,) and s.ignore_eos and not s.skip_special_tokens
    assert s.include_stop_str_in_output and s.seed == 11 and s.logit_bias == ((5, -2.0),)
    assert fake.samplings[-1].max_tokens == 30
    http.post("/generate", json={"text": "x", "sampling_params": {}})
    assert fake.samplings[-1].max_tokens == 128 and fake.samplings[-1].temperature == 1.0  # SGLang's defaults
    assert fake.samplings[-1].priority == 0
    http.post("/generate", json={"text": "x", "priority": 3})
    assert fake.samplings[-1].priority == -3  # SGLang runs higher priorities first, the scheduler lower ones
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for key, value, field in [
        ("json_schema", json.dumps(schema), "json_schema"),
        ("regex", "[0-9]+", "regex"),
        ("ebnf", 'root ::= "yes" | "no"', "grammar"),
    ]:
        fake.reply = "7"
        assert http.post("/generate", json={"text": "x", "sampling_params": {key: value}}).status_code == 200
        assert getattr(fake.samplings[-1], field)


def test_a_batch_with_n_gives_every_choice_in_order(front):
    http, fake, tok = front
    fake.reply = lambda s: "ab" if (s.seed or 0) % 2 else "xyz"
    out = http.post(
        "/generate",
        json={"input_ids": [[5, 6], [7, 8, 9]], "rid": ["r1", "r2"], "sampling_params": {"n": 2, "sampling_seed": 1}},
    ).json()
    assert [o["text"] for o in out] == ["ab", "xyz", "ab", "xyz"] and [o["index"] for o in out] == [0, 1, 2, 3]
    assert [o["meta_info"]["id"] for o in out] == ["r1-0", "r1-1", "r2-0", "r2-1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 3, 3]
    assert [o["output_ids"] for o in out] == [tok.encode(o["text"], add_special_tokens=False) for o in out]
    one = http.post("/generate", json={"text": ["hi"], "sampling_params": {"max_new_tokens": 4}}).json()
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch


def test_stop_strings_and_lengths_are_reported_as_sglang_does(front):
    http, fake, _ = front
    out = http.post("/generate", json={"text": "W?", "sampling_params": {"stop": [" 21"]}}).json()
    assert out["text"] == "Sunny," and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 21"}
    kept = http.post("/generate", json={"text": "W?", "sampling_params": {"stop": [" 21"], "no_stop_trim": True}})
    assert kept.json()["text"] == "Sunny, 21" and kept.json()["meta_info"]["finish_reason"]["matched"] == " 21"
    fake.reply = lambda s: "abcdefgh"[: s.max_tokens]
    cut = http.post("/generate", json={"text": "W?", "sampling_params": {"max_new_tokens": 3}}).json()
    assert cut["text"] == "abc" and cut["meta_info"]["finish_reason"]["type"] == "stop"  # the double ends it


def test_a_stream_carries_each_choices_text_and_ids_so_far(front):
    http, fake, tok = front
    with http.stream(
        "POST", "/generate", json={"text": "W?", "stream": True, "sampling_params": {"n": 2, "sampling_seed": 3}}
    ) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    for i in range(2):
        mine = [e for e in events if e["index"] == i]
        assert [len(e["output_ids"]) for e in mine[:-1]] == list(range(1, len(mine)))  # cumulative, a token each
        assert mine[-1]["text"] == "Sunny, 21 C." and mine[-1]["meta_info"]["finish_reason"]["type"] == "stop"
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])
        assert mine[-1]["output_ids"] == tok.encode("Sunny, 21 C.", add_special_tokens=False)


def test_prompt_logprobs_from_logprob_start_len(front):
    """``logprob_start_len`` >= 0 asks for the prompt's logprobs from that position (the prompt is then computed
    whole, as with the completions endpoint's ``prompt_logprobs``); the double makes each one up as -1."""
    http, fake, _ = front
    body = {
        "input_ids": [5, 6, 7],
        "return_logprob": True,
        "top_logprobs_num": 1,
        "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 4},
    }
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert fake.samplings[-1].prompt_logprobs == 1
    assert meta["input_token_logprobs"] == [[-1.0, 6, None], [-1.0, 7, None]]
    assert meta["input_top_logprobs"] == [[[-1.0, 6, None]], [[-1.0, 7, None]]]
    meta = http.post("/generate", json={**body, "logprob_start_len": 0, "return_text_in_logprobs": True}).json()
    assert meta["meta_info"]["input_token_logprobs"][0] == [None, 5, "\x05"]
    assert (
        "input_token_logprobs" not in http.post("/generate", json={**body, "logprob_start_len": -1}).json()["meta_info"]
        and fake.samplings[-1].prompt_logprobs is None
    )


@pytest.mark.parametrize(
    "body, param, why",
    [
        ({"text": "a", "input_ids": [1]}, "text", "either text or input_ids"),
        ({}, "text", "either text or input_ids"),
        ({"input_ids": []}, "text", "not empty"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", "greater"),
        ({"text": "a", "sampling_params": {"temperature": 9}}, "sampling_params.temperature", "less than"),
        ({"text": "a", "sampling_params": {"lora_path": "x"}}, "sampling_params", "not supported: lora_path"),
        ({"text": "a", "sampling_params": {"json_schema": "{nope"}}, "sampling_params", "not JSON"),
        ({"text": "a", "logprob_start_len": -2}, "logprob_start_len", "a prompt position"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num", "less than"),
        ({"text": "a", "image_data": "x"}, "image_data", "Extra inputs"),
        ({"text": ["a", "b"], "rid": ["one"]}, "rid", "1 ids for 2 prompts"),
        ({"text": "a", "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params", "one set"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens", "context"),
        ({"input_ids": [10**7]}, "input_ids", "token ids must be"),
    ],
)
def test_bad_requests_are_400s_naming_sglangs_field(front, body, param, why):
    http, _, _ = front
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.json()
    assert r.json()["error"]["param"] == param and why in r.json()["error"]["message"], r.json()


def test_lora_path_names_a_served_adapter(tiny_dirs, tiny_adapters, tmp_path):
    """SGLang's ``lora_path``: the request runs under that served adapter (its identity in the engines' sampling),
    a list must name one adapter, and an unknown one is a 400 naming the field."""
    from dualpath.core.lora import LoraModule, adapter_digest

    modules = tuple(LoraModule(k, str(p)) for k, p in tiny_adapters.items())
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, lora_modules=modules)
    fake.reply = "ok"
    assert http.post("/generate", json={"text": "x", "lora_path": "sql"}).status_code == 200
    assert fake.samplings[-1].adapter == adapter_digest(tiny_adapters["sql"])
    assert http.post("/generate", json={"text": ["x", "y"], "lora_path": ["poet", "poet"]}).status_code == 200
    assert fake.samplings[-1].adapter == adapter_digest(tiny_adapters["poet"])
    http.post("/generate", json={"text": "x"})
    assert fake.samplings[-1].adapter == ""
    for bad in ("nope", ["sql", "poet"]):
        r = http.post("/generate", json={"text": ["x", "y"], "lora_path": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.json()
    assert "'sql'" in http.post("/generate", json={"text": "x", "lora_path": "nope"}).json()["error"]["message"]
    assert 'dualpath_lora_requests_total{adapter="poet"} 1.0' in http.get("/metrics").text
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("m", None), ("sql", "m"), ("poet", "m")]
