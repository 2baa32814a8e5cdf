"""The HTTP frontend against an attacker who reaches its port (issue 54), with the scripted cluster of the frontend
tests: admin routes are off unless enabled and then need the admin key; a browser page cannot make the server act
(a text/plain or form POST is a 415); weight and adapter paths stay under --allowed-model-dirs; bodies are refused
while read; tokenizing and chat templates are bounded and off the event loop; stop strings are bounded; one key
cannot take every generation slot, nor read, delete, continue or abort another key's responses and requests; keys
are compared in constant time; stored responses are bounded in bytes and private files."""

import asyncio
import json
import os
import stat
import threading
import time

import httpx
import pytest

from dualpath.core.errors import ConfigError, RequestError
from dualpath.core.lora import adapter_digest
from dualpath.core.messages import Ack, AdapterLoadReply, HoldReply, WeightUpdateReply
from dualpath.core.sampling_params import MAX_STOP_CHARS, MAX_STOPS, SamplingParams
from dualpath.serving.response_store import DirectoryResponses, MemoryResponses
from test_frontend_api import EndlessHandle, _serving
from test_tools import HERMES_TEMPLATE, serve

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
USER, OTHER, ADMIN = ({"Authorization": f"Bearer {k}"} for k in ("user-key", "other-key", "admin-key"))


def recording(fake) -> list:
    """The scripted cluster's admin calls, recorded as they come (none may come from a refused request)."""
    calls = []
    fake.hold = lambda *a: calls.append("hold") or HoldReply()
    fake.flush_cache = lambda: calls.append("flush") or Ack()
    fake.update_weights = lambda path, *a: calls.append(("update", path)) or WeightUpdateReply(True, fingerprint="f")
    fake.load_adapter = lambda path, *a: (
        calls.append(("adapter", path)) or AdapterLoadReply(True, digest=adapter_digest(path), engines=1)
    )
    abort = fake.abort
    fake.abort = lambda label="", every=False: calls.append(("abort", label, every)) or abort(label, every)
    return calls


def admin_routes(model_dir: str, adapter: str) -> list[tuple[str, dict | None]]:
    """Every admin route with a body it would act on (None: no body, as ``curl -X POST`` sends)."""
    return [
        ("/update_weights_from_disk", {"model_path": model_dir}),
        ("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": adapter}),
        ("/load_lora_adapter", {"lora_name": "a2", "lora_path": adapter}),
        ("/v1/unload_lora_adapter", {"lora_name": "a1"}),
        ("/unload_lora_adapter", {"lora_name": "a2"}),
        ("/flush_cache", None),
        ("/reset_prefix_cache", None),
        ("/pause", None),
        ("/resume", None),
        ("/pause_generation", {}),
        ("/continue_generation", None),
        ("/abort_request", {"abort_all": True}),
    ]


@pytest.fixture
def keyed(tiny_dirs, tiny_adapters, tmp_path):
    """A frontend with two inference keys and an admin key, its admin routes on; its cluster's admin calls."""
    http, fake, tok = serve(
        tiny_dirs,
        tmp_path,
        HERMES_TEMPLATE,
        api_key="user-key",
        api_keys=("other-key",),
        admin_api_key="admin-key",
        enable_admin_api=True,
        allowed_model_dirs=(str(tmp_path), str(tiny_adapters["sql"].parent)),
    )
    fake.reply = "ok"
    return http, fake, recording(fake)


def test_admin_routes_are_off_unless_enabled(tiny_dirs, tiny_adapters, tmp_path):
    """Before: every one answered anyone (a weight update replaced the model's weights). Now: a 403 naming the flag,
    nothing done, whoever asks (the admin key too)."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, admin_api_key="admin-key")
    calls = recording(fake)
    for path, body in admin_routes(str(tmp_path / "tok"), str(tiny_adapters["sql"])):
        for who in ({}, ADMIN):
            r = http.post(path, json=body, headers=who)
            assert r.status_code == 403 and "--enable-admin-api" in r.json()["error"]["message"], (path, r.text)
    assert http.get("/flush_cache").status_code == 405  # no GET changes anything
    assert calls == []


def test_admin_routes_need_the_admin_key_not_an_inference_key(keyed, tiny_adapters, tmp_path):
    """Before: the one key was the admin key too. Now: no key is a 401, an inference key a 403, the admin key
    runs the route."""
    http, fake, calls = keyed
    for path, body in admin_routes(str(tmp_path / "tok"), str(tiny_adapters["sql"])):
        done = len(calls)
        assert http.post(path, json=body).status_code == 401, path
        for who in (USER, OTHER):
            r = http.post(path, json=body, headers=who)
            assert r.status_code == 403 and "admin" in r.json()["error"]["message"], (path, r.text)
        assert len(calls) == done
        r = http.post(path, json=body, headers=ADMIN)
        assert r.status_code == 200, (path, r.text)
    assert ("update", os.path.realpath(tmp_path / "tok")) in calls and ("abort", "", True) in calls
    assert calls.count("hold") == 4 and calls.count("flush") == 2
    assert http.post("/v1/chat/completions", json=CHAT, headers=ADMIN).status_code == 200  # it may generate too


def test_the_admin_key_differs_from_every_inference_key(tiny_dirs, tmp_path):
    with pytest.raises(ConfigError, match="admin API key must differ"):
        serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, api_key="same", admin_api_key="same")


def test_without_an_admin_key_admin_routes_answer_only_on_loopback(tiny_dirs, tmp_path):
    """vLLM's dev mode needs no key; here that holds only for a server bound to loopback alone, asked by a loopback
    name (a page rebinding its own name to 127.0.0.1 still sends its name)."""
    from fastapi.testclient import TestClient

    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, enable_admin_api=True, bind_host="0.0.0.0")
    calls = recording(fake)
    local = TestClient(http.front.app, base_url="http://127.0.0.1:8000")
    r = local.post("/pause")
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    (tmp_path / "lo").mkdir()
    http, fake, _ = serve(tiny_dirs, tmp_path / "lo", HERMES_TEMPLATE, enable_admin_api=True, bind_host="127.0.0.1")
    calls = recording(fake)
    assert http.post("/pause").status_code == 403  # Host: testserver
    assert http.post("/pause", headers={"Host": "evil.example:8000"}).status_code == 403
    for base in ("http://127.0.0.1:8000", "http://localhost", "http://[::1]:8000"):
        assert TestClient(http.front.app, base_url=base).post("/resume").status_code == 200, base
    assert calls == ["hold"] * 3


def test_vllm_environment_names_turn_the_admin_routes_on(monkeypatch):
    from dualpath.cli import build_parser
    from dualpath.serving.serve import http_options

    args = build_parser().parse_args(["frontend", "--scheduler", "x:1", "--host", "127.0.0.1"])
    assert not http_options(args)["enable_admin_api"] and not http_options(args)["runtime_lora_updating"]
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert http_options(args)["enable_admin_api"] and http_options(args)["runtime_lora_updating"]


def test_vllms_lora_variable_opens_the_adapter_routes_alone(tiny_dirs, tmp_path):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, runtime_lora_updating=True, admin_api_key="admin-key")
    recording(fake)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # the route ran
    r = http.post("/pause", headers=ADMIN)
    assert r.status_code == 403 and "VLLM_SERVER_DEV_MODE" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "headers, content",
    [
        ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, b'{"mode": "abort"}'),
        ({"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example"}, b"mode=abort"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--"),
        ({"Origin": "http://evil.example"}, b""),  # a page's bodiless fetch
        ({"Content-Type": "text/plain"}, b""),
    ],
)
def test_a_post_a_web_page_could_send_is_refused_before_it_runs(tiny_dirs, tmp_path, headers, content):
    """Before: /pause_generation ran from a text/plain POST carrying a foreign Origin (a page any site serves can
    send one without asking). Now: a 415, nothing run, even on a loopback server that takes no admin key."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, enable_admin_api=True, bind_host="127.0.0.1")
    calls = recording(fake)
    for path in ("/pause_generation", "/pause", "/v1/chat/completions"):
        r = http.post(path, content=content, headers={**headers, "Host": "127.0.0.1:8000"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (path, r.text)
    assert calls == [] and fake.prompts == []
    ok = http.post("/pause_generation", json={}, headers={"Host": "127.0.0.1:8000"})
    assert ok.status_code == 200 and http.post("/resume", headers={"Host": "127.0.0.1"}).status_code == 200


def test_weight_and_adapter_paths_stay_under_the_allowed_dirs(tiny_dirs, tiny_adapters, tmp_path):
    """Before: any path loaded (``../`` too), and errors told whether it existed. Now: ``..`` and symbolic links
    are resolved first, and a path outside is refused with the rule, the same answer whether or not it exists."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    (outside / "ckpt").mkdir(parents=True)
    (allowed / "link").symlink_to(outside / "ckpt")
    (allowed / "inside").mkdir()
    http, fake, _ = serve(
        tiny_dirs,
        tmp_path,
        HERMES_TEMPLATE,
        enable_admin_api=True,
        admin_api_key="admin-key",
        allowed_model_dirs=(str(allowed),),
    )
    calls = recording(fake)
    escapes = [
        str(allowed / ".." / "outside" / "ckpt"),
        str(allowed / "link"),
        str(outside / "ckpt"),
        str(outside / "no-such-dir"),
        "/etc",
        "allowed/../../etc",
        str(allowed) + "-sibling",
        "a\0b",
    ]
    for field, path, extra in (
        ("model_path", "/update_weights_from_disk", {}),
        ("lora_path", "/v1/load_lora_adapter", {"lora_name": "x"}),
    ):
        answers = set()
        for p in escapes:
            r = http.post(path, json={field: p, **extra}, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (p, r.text)
            answers.add(r.json()["error"]["message"])
        assert answers == {f"{field} must be under one of the --allowed-model-dirs"}
    assert calls == []
    r = http.post("/update_weights_from_disk", json={"model_path": str(allowed / "x" / ".." / "inside")}, headers=ADMIN)
    assert r.status_code == 200 and calls == [("update", os.path.realpath(allowed / "inside"))]


def test_the_default_allowed_dirs_hold_the_model_and_its_adapters(tiny_dirs, tiny_adapters, tmp_path):
    from dualpath.core.lora import LoraModule

    http, fake, _ = serve(
        tiny_dirs,
        tmp_path,
        HERMES_TEMPLATE,
        enable_admin_api=True,
        admin_api_key="admin-key",
        lora_modules=(LoraModule("sql", str(tiny_adapters["sql"])),),
    )
    calls = recording(fake)
    assert http.front.model_dirs == (os.path.realpath(tmp_path), os.path.realpath(tiny_adapters["sql"].parent))
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(tiny_adapters["poet"])}, headers=ADMIN
    )  # beside a served adapter
    assert r.status_code == 200, r.text
    assert (
        http.post("/update_weights_from_disk", json={"model_path": str(tiny_dirs["llama"])}, headers=ADMIN).status_code
        == 400
    )  # another test directory
    assert calls == [("adapter", os.path.realpath(tiny_adapters["poet"]))]


async def _ask(app, headers: list, chunks, method: str = "POST", path: str = "/v1/chat/completions") -> tuple[int, int]:
    """One request to the ASGI app whose body comes from ``chunks``; (its status, the chunks the app read)."""
    read, status = [0], []
    body = iter(chunks)

    async def receive():
        chunk = next(body, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        read[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in [("host", "testserver"), *headers]],
        "client": ("127.0.0.1", 5),
        "server": ("testserver", 80),
    }
    await app(scope, receive, send)
    return status[0], read[0]


def endless(chunk: bytes):
    while True:
        yield chunk


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate", "/tokenize", "/v1/nowhere"])
def test_an_oversize_body_is_refused_while_it_is_read(tiny_dirs, tmp_path, path):
    """Before: a body was read whole, then measured. Now: the first chunk past --max-body-bytes ends the request
    (413), the rest never read; a larger Content-Length is refused before any."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, max_body_bytes=1 << 20)
    app, json_type = http.front.app, ("content-type", "application/json")
    status, read = asyncio.run(_ask(app, [json_type], endless(b" " * (64 << 10)), path=path))
    assert (status, read) == (413, 17) if path != "/v1/nowhere" else status == 404  # 17 x 64 KiB > 1 MiB
    status, read = asyncio.run(_ask(app, [json_type, ("content-length", str(2 << 20))], endless(b" "), path=path))
    assert (status, read) == (413, 0)
    assert asyncio.run(_ask(app, [json_type], [b" " * (1 << 20)], path="/tokenize"))[0] == 400  # at the limit: read
    assert fake.prompts == []


def _post_while_health_answers(url: str, body: dict, after_s: float, within_s: float):
    """POST ``body`` on a thread; ``after_s`` in, ``/health`` must answer within ``within_s`` (the event loop is free).
    The POST's response and how long it took."""
    got = {}

    def post():
        t0 = time.monotonic()
        got["r"] = httpx.post(url, json=body, timeout=60)
        got["s"] = time.monotonic() - t0

    t = threading.Thread(target=post)
    t.start()
    time.sleep(after_s)
    t0 = time.monotonic()
    health = url.split("/", 3)
    assert httpx.get("/".join(health[:3]) + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < within_s
    t.join(60)
    return got["r"], got["s"]


def test_an_oversize_tokenize_is_refused_at_once_and_health_answers_meanwhile(tiny_dirs, tmp_path):
    """Before: a 40 MB /tokenize took 52 s on the event loop and stalled /health. Now: a text longer than a prompt
    of the context can be is refused before it is tokenized, and tokenizing runs off the event loop."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, max_body_bytes=64 << 20)
    url, stop, thread = _serving(http.front, drain_s=1)
    try:
        r, took = _post_while_health_answers(url + "/tokenize", {"prompt": "hello world " * 400_000}, 0.3, 1.0)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and took < 2.0, (r.text, took)
        assert "65536" in r.json()["error"]["message"]  # 16 characters per token of the 4096-token context
        r = httpx.post(url + "/tokenize", json={"prompt": "hello world " * 1000}, timeout=30)
        assert r.status_code == 200 and r.json()["count"] > 1000
        r = httpx.post(url + "/detokenize", json={"tokens": [104] * 4097}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x" * 65537}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and fake.prompts == []
    finally:
        stop()
        thread.join(20)


RUNAWAY = (
    "{% for i in range(5000) %}{% for j in range(5000) %}{% if messages[0] is defined and j < 0 %}x{% endif %}"
    "{% endfor %}{% endfor %}"
)


def test_a_runaway_request_chat_template_times_out_and_health_answers_meanwhile(tiny_dirs, tmp_path):
    """Before: a request's own template (--trust-request-chat-template) rendered on the event loop for as long as
    it ran, /health stalled behind it. Now: it renders on a worker thread and is cut at --render-timeout (a 400);
    one that renders fast but huge is refused by its size."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, trust_request_chat_template=True, render_timeout_s=2.0)
    url, stop, thread = _serving(http.front, drain_s=1)
    try:
        r, took = _post_while_health_answers(url + "/v1/chat/completions", {**CHAT, "chat_template": RUNAWAY}, 0.2, 0.5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template" and took < 5, r.text
        assert "ran past 2 s" in r.json()["error"]["message"]
        huge = {**CHAT, "chat_template": "{{ 'x' * 1000000 }}"}
        r = httpx.post(url + "/v1/chat/completions", json=huge, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        for bomb in ("{{ 'x' * 10**10 }}", "{{ 10 ** 1000000 }}"):  # one allocation (or computation) no timer stops
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "chat_template": bomb}, timeout=30)
            assert r.status_code == 400 and "would make more than" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 1.5
        r = httpx.post(url + "/tokenize", json={"messages": CHAT["messages"]}, timeout=30)
        assert r.status_code == 200  # the server's own template renders as ever
        assert fake.prompts == []
    finally:
        stop()
        thread.join(20)


def test_stored_responses_and_request_ids_belong_to_the_key_that_made_them(keyed):
    """Before: every key holder could read or delete any stored response and abort any request by rid. Now:
    another key gets a 404, as for an id never used, and an abort by rid ends the caller's own requests only."""
    http, fake, calls = keyed
    made = http.post("/v1/responses", json={"model": "m", "input": "secret plans"}, headers=USER).json()
    rid = made["id"]
    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
        r = http.get(path, headers=OTHER)
        assert r.status_code == 404 and "secret" not in r.text
        assert http.get(path, headers=USER).status_code == 200
    assert http.delete(f"/v1/responses/{rid}", headers=OTHER).status_code == 404
    r = http.post("/v1/responses", json={"model": "m", "input": "go on", "previous_response_id": rid}, headers=OTHER)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert http.get(f"/v1/responses/{rid}", headers=USER).json()["id"] == rid  # still there
    assert http.delete(f"/v1/responses/{rid}", headers=USER).status_code == 200

    http.post("/generate", json={"text": "hi", "rid": "job-1"}, headers=USER)
    user_label = fake.labels[-1]
    assert user_label.endswith(":job-1") and "user-key" not in user_label
    r = http.post("/abort_request", json={"rid": "job-1"}, headers=OTHER)
    assert r.status_code == 404  # nothing of its own: the scripted cluster aborts nothing
    assert calls == [("abort", f"{_tag('other-key')}:job-1", False)]
    calls.clear()
    assert http.post("/abort_request", json={"rid": "job-1"}, headers=ADMIN).status_code == 404
    assert {c[1] for c in calls} == {f"{_tag(k)}:job-1" for k in ("user-key", "other-key", "admin-key")}


def _tag(key: str) -> str:
    from dualpath.serving.auth import key_tag

    return key_tag(key)


def test_one_key_cannot_take_every_generation_slot(tiny_dirs, tmp_path):
    """Before: one client could hold every slot. Now: with two keys or more, one key has half the server's slots
    by default (--max-concurrent-requests-per-key), past them a 429 while the other key still gets in."""
    http, fake, _ = serve(
        tiny_dirs, tmp_path, HERMES_TEMPLATE, api_keys=("user-key", "other-key"), max_concurrent_requests=4
    )
    handles = []
    fake.reply = lambda sampling: handles.append(EndlessHandle()) or handles[-1]
    assert http.front.admission.per_key == 2
    with http.stream(
        "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "n": 2, "stream": True}, headers=USER
    ) as held:
        held_lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        next(held_lines)
        r = http.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=USER)
        assert r.status_code == 429 and "--max-concurrent-requests-per-key" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 3}, headers=OTHER)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # more than one key may ever have
        with http.stream(
            "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}, headers=OTHER
        ) as other:
            assert other.status_code == 200
            other_lines = other.iter_lines()
            next(other_lines)
            assert http.front.in_flight == 3
            for h in handles:
                h.cancel()
            list(other_lines)
        list(held_lines)
    deadline = time.monotonic() + 5
    while http.front.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.front.in_flight == 0 and not http.front.admission.by_owner


@pytest.mark.parametrize(
    "stop",
    [["a", "b", "c", "d", "e"], ["x" * (MAX_STOP_CHARS + 1)], "y" * 1_000_000],
    ids=["five", "257-characters", "one-megabyte"],
)
def test_stop_strings_are_bounded_in_count_and_length(tiny_dirs, tmp_path, stop):
    """Before: stop strings of 1 MB each were taken (each searched for at every token). Now: OpenAI's 4 over HTTP,
    of at most 256 characters; offline, SamplingParams takes at most 16."""
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE)
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
        ("/generate", {"text": "hi", "sampling_params": {"stop": stop}}),
    ):
        r = http.post(path, json={**body, "stop": stop} if path != "/generate" else body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("stop", "sampling_params.stop"), r.text
    assert fake.prompts == []


def test_sampling_params_bound_stop_strings_offline_too():
    SamplingParams(stop=("s",) * MAX_STOPS + (), max_tokens=4)
    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    for stop in (("s",) * (MAX_STOPS + 1), ("x" * (MAX_STOP_CHARS + 1),)):
        with pytest.raises(RequestError, match="stop takes up to") as e:
            SamplingParams(stop=stop)
        assert e.value.field == "stop"


def test_keys_are_compared_in_constant_time(keyed, monkeypatch):
    """Before: the key was compared with ``!=``. Now: ``hmac.compare_digest`` with every key configured."""
    import dualpath.serving.auth as auth

    http, _, _ = keyed
    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert http.get("/v1/models", headers=OTHER).status_code == 200
    assert len(compared) == 3  # the admin key, then both inference keys (no early exit)
    compared.clear()
    assert http.get("/v1/models", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert len(compared) == 3 and all(len(a) == len(b) == 32 for a, b in compared)  # digests: lengths say nothing


def test_several_inference_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    from dualpath.cli import build_parser
    from dualpath.serving.serve import http_options, inference_keys

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nfile-1\n\n  file-2  \n")
    monkeypatch.setenv("DUALPATH_API_KEY", "env-key")
    monkeypatch.setenv("DUALPATH_ADMIN_API_KEY", "env-admin")
    args = build_parser().parse_args(
        ["frontend", "--scheduler", "x:1", "--api-key", "a", "--api-key", "b", "--api-key-file", str(keys)]
    )
    assert inference_keys(args) == ("a", "b", "file-1", "file-2", "env-key")
    assert http_options(args)["admin_api_key"] == "env-admin"
    args.api_key, args.allowed_model_dirs = "yaml-key", "/models"  # a YAML config's single values
    assert inference_keys(args)[0] == "yaml-key" and http_options(args)["allowed_model_dirs"] == ("/models",)
    keys.write_text("# none\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        inference_keys(args)
    monkeypatch.setenv("DUALPATH_ADMIN_API_KEY", "yaml-key")
    keys.write_text("c\n")
    with pytest.raises(ConfigError, match="must differ"):
        http_options(args)
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "Prefer the environment's DUALPATH_API_KEY" in help_text and "DUALPATH_ADMIN_API_KEY" in help_text


def test_server_info_shows_no_key(keyed):
    http, _, _ = keyed
    info = http.get("/get_server_info", headers=USER).json()
    text = json.dumps(info)
    assert "user-key" not in text and "other-key" not in text and "admin-key" not in text
    assert info["api_key_set"] and info["admin_api_key_set"] and info["enable_admin_api"]


def test_stored_responses_are_bounded_in_bytes_and_files_are_private(tmp_path):
    """Before: stored responses were capped by count alone, in files any user could read. Now: by their bytes too
    (the oldest go first; one larger than the cap is not kept), in 0600 files of a 0700 directory."""
    big = "x" * 1000
    memory = MemoryResponses(100, max_bytes=5000)
    for i in range(10):
        memory.put({"id": f"r{i}", "text": big}, [], owner="o")
    assert memory.bytes <= 5000 and memory.get("r9", "o") and not memory.get("r0", "o")
    memory.put({"id": "huge", "text": big * 10}, [], owner="o")
    assert memory.get("huge", "o") is None and memory.get("r9", "o") and not memory.get("r9", "someone else")

    root = tmp_path / "responses"
    store = DirectoryResponses(root, 100, max_bytes=20_000)
    ids = [f"resp_{i:032x}" for i in range(40)]
    for i, rid in enumerate(ids):
        store.put({"id": rid, "text": big}, [{"role": "user", "content": big}], owner="o")
        os.utime(root / f"{rid}.json", (time.time() - 1000 + i,) * 2)  # distinct ages, oldest first
    files = list(root.glob("*.json"))
    assert sum(f.stat().st_size for f in files) <= 20_000 * 1.1 and store.get(ids[-1], "o")
    assert not store.get(ids[0], "o")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    assert store.get(ids[-1], "other") is None and not store.delete(ids[-1], "other") and store.delete(ids[-1], "o")
