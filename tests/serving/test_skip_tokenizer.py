"""vLLM's ``skip_tokenizer_init``: a checkpoint served on token ids alone, without its tokenizer files. Offline
(``LLM``) the replies equal those of the model with its tokenizer, with empty text; through the frontend
(``--skip-tokenizer-init``, a test double of the cluster) completions take token-id prompts and return token ids,
and what needs text (text prompts, chats, stop strings, bad words, structured output) is a 400 naming the flag."""

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from dualpath import LLM, SamplingParams
from dualpath.core.errors import CheckpointError, RequestError
from dualpath.core.messages import TokenEvent
from dualpath.serving.openai_api import Frontend, FrontendConfig

PROMPT = [104, 105, 32, 116, 104, 101, 114, 101]  # "hi there" in the tiny tokenizer (a token a byte)
REPLY = list(b"ok!")


class ScriptedClient:
    """Test double of ``ClusterClient``: every request is answered with the tokens ``REPLY``; the prompts kept."""

    def __init__(self):
        self.prompts = []

    def start(self, prompt, sampling, request_id=None, mode="", label="", agent=None):
        self.prompts.append(list(prompt))
        return ScriptedHandle()

    def stats(self):
        return {"ready": True}

    def abort(self, label="", every=False):
        return 0

    def block_size(self):
        return 16


class ScriptedHandle:
    request_id = "scripted"

    def events(self):
        for k, t in enumerate(REPLY):
            yield TokenEvent(self.request_id, t, finish_reason="stop" if k == len(REPLY) - 1 else "")

    def cancel(self):
        pass


def stream(http, path, body) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.fixture(scope="module")
def bare(tiny_dirs, tmp_path_factory):
    """The tiny Llama without tokenizer.json and tokenizer_config.json."""
    d = tmp_path_factory.mktemp("bare") / "llama"
    shutil.copytree(tiny_dirs["llama"], d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    return d


def test_offline_token_ids_alone_equal_the_model_with_its_tokenizer(tiny_dirs, bare):
    with pytest.raises(CheckpointError, match="skip_tokenizer_init"):  # the refusal says what to do
        LLM(str(bare), block_size=16)
    llm = LLM(str(bare), block_size=16, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=6, temperature=0)
    (out,) = llm.generate([PROMPT], params)
    (want,) = LLM(str(tiny_dirs["llama"]), block_size=16).generate([PROMPT], params)
    assert out.token_ids == want.token_ids and out.prompt_token_ids == PROMPT
    assert out.text == ""  # no detokenizer: the ids are the output
    assert [o.index for o in llm.generate(PROMPT, SamplingParams(max_tokens=2, n=2, seed=1))] == [0, 1]


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda llm: llm.generate("hi there", SamplingParams(max_tokens=2)), "prompt"),
        (lambda llm: llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2)), "messages"),
        (lambda llm: llm.chat([{"role": "user", "content": "hi"}], chat_template="{{ 'x' }}"), "messages"),
        (lambda llm: llm.generate([PROMPT], SamplingParams(max_tokens=2, stop=["x"])), "stop"),
        (lambda llm: llm.generate([PROMPT], SamplingParams(max_tokens=2, json_object=True)), "response_format"),
        (lambda llm: llm.logits("hi"), "prompt"),
    ],
)
def test_offline_what_needs_text_is_refused(bare, call, field):
    llm = LLM(str(bare), block_size=16, skip_tokenizer_init=True)
    with pytest.raises(RequestError, match="tokenizer is not loaded") as e:
        call(llm)
    assert e.value.field == field
    assert not llm.engine.has_work()  # nothing was queued


@pytest.fixture
def served(bare):
    """The frontend on the bare checkpoint (it has no tokenizer), a scripted cluster behind it."""
    fake = ScriptedClient()
    front = Frontend(
        FrontendConfig("m", str(bare), "unused:0", max_model_len=512, skip_tokenizer_init=True), client=fake
    )
    return TestClient(front.app), fake


def test_served_completions_take_and_return_token_ids(served):
    http, fake = served
    r = http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert fake.prompts[-1] == PROMPT and choice["prompt_token_ids"] == PROMPT
    assert choice["token_ids"] == REPLY and choice["text"] == ""
    assert r.json()["usage"]["completion_tokens"] == 3
    batch = http.post("/v1/completions", json={"model": "m", "prompt": [PROMPT, [5, 6]], "max_tokens": 8})
    assert batch.status_code == 200 and fake.prompts[-1] == [5, 6]
    chunks = stream(
        http, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True}
    )
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == REPLY


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi there"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop"),
        ("/v1/completions", {"prompt": PROMPT, "bad_words": ["x"]}, "bad_words"),
        ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_object"}}, "response_format"),
        ("/tokenize", {"prompt": "hi there"}, "prompt"),
        ("/detokenize", {"tokens": PROMPT}, "tokens"),
    ],
)
def test_served_what_needs_text_is_a_400_naming_the_flag(served, path, body, param):
    http, fake = served
    r = http.post(path, json={"model": "m", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "--skip-tokenizer-init" in err["message"], err
    assert not fake.prompts  # nothing was submitted


def test_served_token_ids_are_checked_against_the_models_vocabulary(served):
    http, fake = served
    r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 10**6], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_serve_and_frontend_take_the_flag():
    from dualpath.cli import build_parser

    for cmd in ("serve", "frontend"):
        extra = ["--scheduler", "x:1"] if cmd == "frontend" else []
        assert build_parser().parse_args([cmd, *extra, "--skip-tokenizer-init"]).skip_tokenizer_init
        assert not build_parser().parse_args([cmd, *extra]).skip_tokenizer_init


@pytest.mark.slow
def test_serve_skip_tokenizer_init_on_a_checkpoint_without_tokenizer_files(tiny_dirs, bare, tmp_path):
    """``dualpath serve --skip-tokenizer-init`` end to end: no process of the cluster needs the tokenizer, and the
    reply's ids equal the offline model's."""
    import httpx

    from serve_process import ServeProcess

    server = ServeProcess(
        "--model",
        str(bare),
        "--skip-tokenizer-init",
        "--block-size",
        "16",
        "--buffer-bytes",
        str(8 << 20),
        "--cache-bytes",
        str(32 << 20),
        "--workspace-tokens",
        "2048",
        "--kv-store",
        str(tmp_path / "kv"),
        "--max-model-len",
        "512",
        "--torch-threads",
        "1",
    )
    try:
        body = {"model": "llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        (want,) = LLM(str(tiny_dirs["llama"]), block_size=16).generate(
            [PROMPT], SamplingParams(max_tokens=6, temperature=0)
        )
        assert r.json()["choices"][0]["token_ids"] == want.token_ids and r.json()["choices"][0]["text"] == ""
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=60,
            json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400 and "--skip-tokenizer-init" in chat.json()["error"]["message"]
    finally:
        assert server.stop() == 0, server.log_tail()
