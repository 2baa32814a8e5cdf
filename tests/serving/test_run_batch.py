"""``dualpath run-batch``: OpenAI's batch format through the frontend in-process against a real cluster — answers
equal the single-process reference, every input line gets exactly one output line (bad lines an error, server
errors their OpenAI answer), and a resumed job sends only what it had not answered."""

import json
import time

import pytest

from dualpath import LLM, SamplingParams
from dualpath.core.errors import DualPathError
from dualpath.launcher import ClusterSpec, LocalCluster
from dualpath.serving.batch import BatchConfig, run_batch
from dualpath.serving.openai_api import Frontend, FrontendConfig

BS = 16
CHAT = [{"role": "user", "content": "hello there, how is the weather today?"}]
GREEDY = dict(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def frontend(tiny_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_dirs["llama"]),
        block_size=BS,
        kv_store=str(tmp_path_factory.mktemp("kv")),
        buffer_bytes=8 << 20,
        cache_bytes=32 << 20,
        workspace_tokens=2048,
    )
    with LocalCluster(spec, run_dir=str(tmp_path_factory.mktemp("run"))) as c:
        front = Frontend(FrontendConfig("llama", str(tiny_dirs["llama"]), c.scheduler_address, max_model_len=512))
        yield front
        front.client.close()


def requests() -> list[str]:
    good = [
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "llama", "messages": CHAT, **GREEDY},
        },
        {
            "custom_id": "text",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "llama", "prompt": "The quick brown fox", **GREEDY},
        },
        {
            "custom_id": "resp",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "llama",
                "input": "hello there, how is the weather today?",
                "temperature": 0,
                "max_output_tokens": 6,
            },
        },
        {
            "custom_id": "other-model",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o", "messages": CHAT},
        },
    ]
    bad = [
        '{"custom_id": "cut',
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        json.dumps({**good[0], "body": {**good[0]["body"], "max_tokens": 3}}),  # a second "chat"
        json.dumps({"custom_id": "streamed", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}}),
        json.dumps({"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": "x"}}),
    ]
    return [json.dumps(r) for r in good] + bad


def results(path) -> dict:
    return {(r["custom_id"], r["line"]): r for r in map(json.loads, path.read_text().splitlines())}


def test_a_batch_answers_every_line_once_as_the_server_would(frontend, tiny_dirs, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(requests()) + "\n\n")
    summary = run_batch(frontend.app, src, out, BatchConfig(max_concurrency=3), progress=False)
    got = results(out)
    assert len(got) == len(requests()) == summary["lines"] and summary["succeeded"] == 3 and summary["failed"] == 6
    by_id = {cid: r for (cid, line), r in got.items() if r["response"]}
    reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
    chat_ids = reference.tokenizer.apply_chat_template(CHAT)
    want_chat = reference.generate(chat_ids, SamplingParams(**GREEDY))[0].text
    assert by_id["chat"]["response"]["body"]["choices"][0]["message"]["content"] == want_chat
    assert by_id["resp"]["response"]["body"]["output"][0]["content"][0]["text"] == want_chat
    assert (
        by_id["text"]["response"]["body"]["choices"][0]["text"]
        == reference.generate("The quick brown fox", SamplingParams(**GREEDY))[0].text
    )
    assert by_id["other-model"]["response"]["status_code"] == 404
    expected = {
        5: "is not valid JSON",
        6: "custom_id (a non-empty string) is required",
        7: "is not unique",
        8: "stream is not supported in a batch",
        9: "url must be one of",
    }
    errors = {r["line"]: r["error"]["message"] for r in got.values() if r["response"] is None}
    assert errors.keys() == expected.keys() and all(expected[n] in m for n, m in errors.items()), errors


def test_a_resumed_batch_sends_only_what_was_not_answered(frontend, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(requests()) + "\n")
    run_batch(frontend.app, src, out, BatchConfig(max_concurrency=2), progress=False)
    first = results(out)
    kept = [t for t in out.read_text().splitlines() if json.loads(t)["custom_id"] not in ("text", "streamed")]
    out.write_text("\n".join(kept) + '\n{"custom_id": "text", "resp')  # killed mid-write
    submitted = frontend.client.stats()["submitted"]
    run_batch(frontend.app, src, out, BatchConfig(max_concurrency=2), progress=False)
    assert frontend.client.stats()["submitted"] - submitted == 1  # "text" alone
    again = results(out)
    assert again[("chat", 1)] == first[("chat", 1)] and again[("text", 2)]["response"]["status_code"] == 200
    assert len(results(out)) == len(requests()) == len(out.read_text().splitlines())
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"custom_id": "zzz", "line": 1, "response": {"status_code": 200, "body": {}}}))
    with pytest.raises(DualPathError, match="another batch"):
        run_batch(frontend.app, src, foreign, progress=False)


def test_a_cluster_that_stays_down_ends_the_job_with_an_error(tiny_dirs, tmp_path):
    """Its requests are not each retried for retry_s: once /health has failed for down_s the job ends, saying why."""
    front = Frontend(FrontendConfig("llama", str(tiny_dirs["llama"]), "127.0.0.1:1", max_model_len=512))
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"q{i}",
                    "url": "/v1/completions",
                    "body": {"model": "llama", "prompt": "hi", "max_tokens": 2},
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    start = time.monotonic()
    with pytest.raises(DualPathError, match="unavailable for 1 s.*running the job again resumes"):
        run_batch(front.app, src, tmp_path / "out.jsonl", BatchConfig(max_concurrency=2, down_s=1.0), progress=False)
    assert time.monotonic() - start < 30  # not 4 x retry_s (600 s)
