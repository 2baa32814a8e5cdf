"""The frontend's self-reports (``dualpath.serving.probes``) against a test double of the cluster: SGLang's
``/health_generate`` answers from one real token, a busy server's tokens, or a timeout that lets the probe go;
``/get_model_info``, ``/get_server_info``, vLLM's ``/version`` and ``/ping``. The real cluster's answers, a wedged
engine's included, are checked in ``test_serving.py``."""

import asyncio
import json
import threading
import time
from dataclasses import replace

import httpx
import pytest

import dualpath
from dualpath.core.errors import DualPathError
from dualpath.serving.probes import PROBE_PROMPT
from test_tools import HERMES_TEMPLATE, serve


class StuckHandle:
    """Test double of a request whose engines never answer: its events wait until it is cancelled."""

    request_id = "stuck"

    def __init__(self):
        self.cancelled = threading.Event()
        self.returned = threading.Event()

    def events(self):
        try:
            self.cancelled.wait(30)
            raise DualPathError("cancelled")
            yield  # a generator, as the real handle's
        finally:
            self.returned.set()

    def cancel(self):
        self.cancelled.set()


@pytest.fixture
def front(tiny_dirs, tmp_path):
    http, fake, tok = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, health_generate_timeout_s=0.6)
    fake.reply = "ok"
    return http, fake, tok


def test_health_generate_makes_one_greedy_token_and_counts_no_usage(front):
    http, fake, tok = front
    r = http.get("/health_generate")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert fake.prompts == [tok.encode(PROBE_PROMPT)]
    assert fake.samplings[0].max_tokens == 1 and fake.samplings[0].temperature == 0.0
    counted = [
        ln
        for ln in http.get("/metrics").text.splitlines()
        if ln.startswith(("dualpath_prompt_tokens_total", "dualpath_completion_tokens_total"))
    ]
    assert all(float(ln.split()[-1]) == 0 for ln in counted)  # a probe is not usage
    assert http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}).status_code == 200
    assert any(
        ln.startswith("dualpath_completion_tokens_total") and float(ln.split()[-1]) > 0
        for ln in http.get("/metrics").text.splitlines()
    )  # where a request's are


def test_a_probe_no_engine_answers_is_a_503_within_its_timeout_and_is_let_go(front):
    http, fake, _ = front
    stuck = StuckHandle()
    fake.reply = lambda _s: stuck
    start = time.monotonic()
    r = http.get("/health_generate")
    assert r.status_code == 503 and "no token within 0.6 s" in r.json()["error"]
    assert 0.5 < time.monotonic() - start < 5
    assert stuck.cancelled.wait(5) and stuck.returned.wait(5)  # no thread left waiting on it


def test_another_requests_token_answers_a_waiting_probe(front):
    http, fake, _ = front
    stuck = StuckHandle()
    fake.reply = lambda _s: stuck
    http.front.cfg = replace(http.front.cfg, health_generate_timeout_s=3.0)
    done = threading.Event()

    def other_requests_tokens():  # one every 0.4 s, so one comes after the probe began however late it begins
        while not done.wait(0.4):
            http.front.last_token_at = time.perf_counter()

    threading.Thread(target=other_requests_tokens, daemon=True).start()
    start = time.monotonic()
    r = http.get("/health_generate")
    done.set()
    assert r.status_code == 200 and time.monotonic() - start < 2.5
    assert stuck.cancelled.wait(10)  # the probe's own generation is let go (at its timeout, at the latest)


def test_generations_mark_when_their_tokens_arrive(front):
    http, fake, _ = front
    before = time.perf_counter()
    assert http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}).status_code == 200
    assert http.front.last_token_at > before


def test_concurrent_probes_share_one_generation(front):
    http, fake, _ = front

    async def probes():
        transport = httpx.ASGITransport(app=http.front.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await asyncio.gather(*[c.get("/health_generate") for _ in range(4)])

    stuck = StuckHandle()
    fake.reply = lambda _s: stuck
    http.front.cfg = replace(http.front.cfg, health_generate_timeout_s=10.0)
    threading.Timer(0.3, stuck.cancel).start()  # it fails: every probe says so
    answers = asyncio.run(probes())
    assert [a.status_code for a in answers] == [503] * 4 and len(fake.prompts) == 1
    assert all("failed" in a.json()["error"] for a in answers)


@pytest.mark.parametrize(
    "stats, why",
    [
        ({"ready": False}, "lacks engines"),
        (
            {"ready": False, "missing": ["no prefill engine alive for 12 s (prefill-0 is gone: exited)"]},
            "no prefill engine alive for 12 s (prefill-0 is gone: exited)",
        ),
        ({"ready": True, "paused": True}, "weights are being updated"),
        (DualPathError("connection refused"), "did not answer"),
    ],
)
def test_a_cluster_that_cannot_serve_is_a_503_at_once(front, stats, why):
    http, fake, _ = front
    fake.stats = (lambda: (_ for _ in ()).throw(stats)) if isinstance(stats, Exception) else (lambda: stats)
    r = http.get("/health_generate")
    assert r.status_code == 503 and why in r.json()["error"] and not fake.prompts


def test_health_names_what_is_missing(front):
    http, fake, _ = front
    fake.stats = lambda: {"ready": False, "missing": ["no decode engine has registered yet"]}
    r = http.get("/health")
    assert r.status_code == 503 and r.json() == {
        "status": "unavailable",
        "missing": ["no decode engine has registered yet"],
    }
    fake.stats = lambda: {"ready": True}
    assert http.get("/health").json() == {"status": "ok"}


def test_a_probe_that_cannot_be_submitted_is_a_503(front):
    http, fake, _ = front
    fake.reply = DualPathError("the scheduler refused it")
    r = http.get("/health_generate")
    assert r.status_code == 503 and "refused it" in r.json()["error"]


def test_model_info_follows_a_weight_update(front, tiny_dirs, tmp_path):
    http, fake, _ = front
    cfg = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    (tmp_path / "tok" / "config.json").write_text(json.dumps(cfg))
    info = http.get("/get_model_info").json()
    assert info["model_path"] == info["tokenizer_path"] == str(tmp_path / "tok")
    assert info["is_generation"] and info["model_type"] == cfg["model_type"]
    assert info["architectures"] == cfg["architectures"] and info["weight_version"] == ""
    fake.stats = lambda: {"ready": True, "weights_path": "/ckpt/step-2", "weights_version": "step-2"}
    info = http.get("/get_model_info").json()
    assert info["model_path"] == "/ckpt/step-2" and info["weight_version"] == "step-2"


def test_server_info_and_version(tiny_dirs, tmp_path):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, api_key="secret")
    assert http.get("/get_server_info").status_code == 401
    info = http.get("/get_server_info", headers={"Authorization": "Bearer secret"}).json()
    assert "api_key" not in info and info["api_key_set"] and "secret" not in json.dumps(info)
    assert info["max_model_len"] == 4096 and info["version"] == dualpath.__version__
    assert info["internal_states"] == [{"ready": True}]
    assert http.get("/version").json() == {"version": dualpath.__version__}  # no key needed, as vLLM's
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200
    fake.stats = lambda: {"ready": False}
    assert http.get("/ping").status_code == 503


def test_load_counts_the_generations_in_flight(front):
    """vLLM's ``/load``: what a load balancer reads (no key needed, as ``/version``)."""
    http, fake, _ = front
    stuck = StuckHandle()
    fake.reply = lambda _s: stuck
    assert http.get("/load").json() == {"server_load": 0}
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "n": 2}
    waiting = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": body})
    waiting.start()
    deadline = time.monotonic() + 10
    while http.get("/load").json()["server_load"] != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert http.get("/load").json() == {"server_load": 2}  # each choice is a generation
    stuck.cancel()
    waiting.join(10)
    assert http.get("/load").json() == {"server_load": 0}


# --- request ids ------------------------------------------------------------------------------------------------
def test_a_clients_request_id_names_the_response_and_the_submission(front):
    http, fake, _ = front
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"
    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True},
        headers={"X-Request-Id": "trace-42"},
    ) as s:
        ids = {json.loads(ln[6:])["id"] for ln in s.iter_lines() if ln.startswith("data: {")}
    assert s.headers["x-request-id"] == "trace-42" and ids == {"cmpl-trace-42"}
    first, second = fake.request_ids[-2:]
    assert first.startswith("trace-42-") and second.startswith("trace-42-") and first != second  # reused: unique


@pytest.mark.parametrize("given", [None, "has spaces", "x" * 129, "a/b", "<script>"])
def test_without_a_usable_request_id_one_is_made(front, given):
    http, fake, _ = front
    headers = {"X-Request-Id": given} if given else {}
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}, headers=headers)
    made = r.headers["x-request-id"]
    assert made != given and len(made) == 32 and r.json()["id"] == f"cmpl-{made}"
    assert fake.request_ids[-1].startswith(made + "-")
    assert http.get("/health").headers["x-request-id"]  # every response carries one


@pytest.mark.parametrize(
    "query, why",
    [
        ("mode=keep", "freezes requests"),
        ("mode=later", "'abort' or 'wait'"),
        ("mode=wait&timeout=0", "timeout"),
        ("mode=wait&timeout=inf", "timeout"),
        ("timeout=nan", "timeout"),
    ],
)
def test_pauses_it_cannot_make_are_400s_and_hold_nothing(tiny_dirs, tmp_path, query, why):
    http, fake, _ = serve(tiny_dirs, tmp_path, HERMES_TEMPLATE, enable_admin_api=True, admin_api_key="admin")
    fake.hold = lambda *a: pytest.fail("held")
    r = http.post(f"/pause?{query}", headers={"Authorization": "Bearer admin"})
    assert r.status_code == 400 and why in r.json()["error"]["message"]
