"""vLLM's ``return_token_ids``: the prompt's token ids and each choice's, non-streamed and streamed (the chunks'
ids join to the whole), for chats and completions, following ``best_of``'s choice (the frontend against a test
double of the cluster; the tiny model's tokenizer is one token per byte)."""

import json

from test_tools import HERMES_TEMPLATE, WEATHER, chat, serve


def stream(http, path, body) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_a_chats_ids_are_its_rendered_prompt_and_its_reply(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = "Sunny, 21 C."
    messages = [{"role": "user", "content": "Weather?"}]
    body = chat(http, messages=messages, return_token_ids=True, n=2).json()
    rendered = http.post("/tokenize", json={"model": "m", "messages": messages}).json()["tokens"]
    assert body["prompt_token_ids"] == rendered == fake.prompts[-1]
    assert [c["token_ids"] for c in body["choices"]] == [tok.encode("Sunny, 21 C.", add_special_tokens=False)] * 2
    assert "token_ids" not in chat(http, messages=messages).json()["choices"][0]  # only when asked

    chunks = stream(
        http,
        "/v1/chat/completions",
        {"model": "m", "messages": messages, "return_token_ids": True, "n": 2, "stop": [" 21"]},
    )
    assert chunks[0]["prompt_token_ids"] == rendered and "prompt_token_ids" not in chunks[1]
    for i in range(2):
        ids = [t for c in chunks for ch in c["choices"] if ch["index"] == i for t in ch.get("token_ids", [])]
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"] if ch["index"] == i)
        assert text == "Sunny," and ids == tok.encode("Sunny, 21", add_special_tokens=False)  # the stop's token too


def test_a_tool_calls_ids_arrive_while_its_text_is_held(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    fake.reply = reply
    chunks = stream(
        http,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "W?"}], "tools": [WEATHER], "return_token_ids": True},
    )
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert ids == tok.encode(reply, add_special_tokens=False)
    assert all(len(ch.get("token_ids", [])) <= 1 for c in chunks for ch in c["choices"])  # each as it came
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_completions_carry_each_prompts_ids_in_its_choices(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = lambda s: "abc" if s.seed % 2 else "wxyz"  # best_of ranks by logprob: both seeds answer
    body = http.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": [[5, 6], [7, 8, 9]],
            "max_tokens": 8,
            "n": 2,
            "seed": 1,
            "return_token_ids": True,
        },
    )
    assert body.status_code == 200, body.json()
    body = body.json()
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[5, 6]] * 2 + [[7, 8, 9]] * 2
    assert [c["token_ids"] for c in body["choices"]] == [
        tok.encode(c["text"], add_special_tokens=False) for c in body["choices"]
    ]
    chunks = stream(
        http,
        "/v1/completions",
        {"model": "m", "prompt": [7, 8, 9], "max_tokens": 8, "seed": 2, "return_token_ids": True, "echo": True},
    )
    firsts = [ch for c in chunks for ch in c["choices"] if "prompt_token_ids" in ch]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == [7, 8, 9]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert ids == tok.encode("wxyz", add_special_tokens=False)


def test_best_of_returns_the_ids_of_the_choice_it_keeps(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    fake.reply = lambda s: "abc" if s.seed % 2 else "wxyz"
    body = http.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 8, "best_of": 3, "seed": 4, "return_token_ids": True},
    ).json()
    choice = body["choices"][0]
    assert choice["token_ids"] == tok.encode(choice["text"], add_special_tokens=False)
