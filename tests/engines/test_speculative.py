"""Speculative decoding by prompt lookup: the proposer against a brute-force search, and outputs (tokens, finish
reasons, logprobs within 1e-5) identical to plain decoding, in one process and through the decode engine."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from dualpath import LLM, SamplingParams
from dualpath.cli import build_parser
from dualpath.client import ClusterClient
from dualpath.core.config import SpeculativeConfig
from dualpath.core.errors import ConfigError
from dualpath.launcher import ClusterSpec, LocalCluster
from dualpath.engines.spec import PromptLookup
from dualpath.scheduler.http import render

BS = 16
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPTS = [[(i * 11) % 250 + 3 for i in range(50)], [5, 6, 7, 8] * 10, list(range(3, 40)), [9]]


def brute_force(tokens, k, min_n, max_n):
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for s in range(length - n - 1, -1, -1):
            if tokens[s : s + n] == tokens[length - n :]:
                return tokens[s + n : s + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=60),
    st.integers(0, 60),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_prompt_lookup_matches_a_brute_force_search(tokens, cut, k, min_n, extra):
    cut = min(cut, len(tokens))
    lookup = PromptLookup(tokens[:cut])
    lookup.extend(tokens[cut:])  # grown as a sequence grows
    assert lookup.propose(k, min_n, min_n + extra) == brute_force(tokens, k, min_n, min_n + extra)


def test_the_config_reads_vllms_json_and_refuses_the_rest():
    assert SpeculativeConfig.parse(json.dumps(SPEC)) == SpeculativeConfig(4, 1, 4)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 1}) == SpeculativeConfig(2, 1, 1)
    assert SpeculativeConfig.parse("").num_tokens == 0
    for bad, why in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "ngram"),
        ({"prompt_lookup_max": 2}, "give"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown: draft_model"),
        ({"num_speculative_tokens": "many"}, "invalid literal"),
        ("[", "not a JSON object"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "min_n <= max_n"),
    ]:
        with pytest.raises(ConfigError, match=why):
            SpeculativeConfig.parse(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "medusa"}'])
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    assert SpeculativeConfig.parse(args.speculative_config).num_tokens == 4


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    """Plain and speculative runtimes of one model."""
    return {
        arch: (
            LLM(str(tiny_dirs[arch]), block_size=BS),
            LLM(str(tiny_dirs[arch]), block_size=BS, speculative_config=SPEC),
        )
        for arch in ("llama", "deepseek_v3", "deepseek_v32")
    }


def same(plain, spec, params, prompts=PROMPTS):
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if params.logprobs is not None:  # one forward over several rows rounds its last bits otherwise
            for x, y in zip(g.logprobs, w.logprobs):
                assert abs(x.logprob - y.logprob) < 1e-5 and [t for t, _ in x.top] == [t for t, _ in y.top]
                assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(x.top, y.top))
    return got


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=50, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=40, n=3, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=40, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=60, stop=["\x9c\x9c"], logit_bias={156: 3.0}),
        SamplingParams(temperature=0, max_tokens=80, json_schema=SCHEMA),
        SamplingParams(temperature=0, max_tokens=2),
        SamplingParams(temperature=0, max_tokens=1),
    ],
    ids=["greedy", "seeded", "n3-penalties", "min-tokens", "stop-bias", "schema", "two", "one"],
)
def test_speculative_decoding_changes_no_output(pair, params):
    plain, spec = pair["llama"]
    before = dict(spec.engine.spec_stats)
    same(plain, spec, params)
    drafted = spec.engine.spec_stats["drafted"] - before["drafted"]
    if params.max_tokens <= 2:
        assert drafted == 0  # a step keeps at most drafts + 1 tokens: no room after the prefill's token
    elif params.greedy and not params.structured and not params.frequency_penalty:
        assert spec.engine.spec_stats["accepted"] > before["accepted"]  # the tiny model repeats itself


def test_bad_words_hold_under_speculation(pair):
    """A draft that would complete a bad word is drawn against: the step's later positions see the tokens kept
    before them, as plain decoding does."""
    plain, spec = pair["llama"]
    free = plain.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    words = (tuple(free[10:12]), tuple(free[20:23]))
    got = same(
        plain, spec, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, bad_words=words), [PROMPTS[1]]
    )[0].token_ids
    assert got != free and not any(tuple(got[i : i + len(w)]) == w for w in words for i in range(len(got)))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_mla_models_too(pair, arch):
    """DeepSeek-V3.2 too: a step verifying drafts scores them in one forward, and each row's sparse choice is the
    one its plain decode step makes."""
    plain, spec = pair[arch]
    same(plain, spec, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert spec.engine.spec_stats["accepted"] > 0


def test_a_full_cache_or_context_leaves_no_room_for_drafts(tiny_dirs):
    """Drafts only take free blocks and never run past the context: a cache of few blocks and a prompt near
    ``max_model_len`` give the same outputs."""
    kw = dict(block_size=BS, num_kv_blocks=9, max_model_len=140)
    plain, spec = LLM(str(tiny_dirs["llama"]), **kw), LLM(str(tiny_dirs["llama"]), speculative_config=SPEC, **kw)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    got = same(plain, spec, params, [PROMPTS[0], PROMPTS[1] * 2 + [3] * 30])
    assert {g.finish_reason for g in got} == {"length"}


@pytest.mark.slow  # ~10 s, a cluster of its own; the outputs are the in-process tests' above
def test_the_decode_engine_speculates_with_the_same_outputs(tiny_dirs, tmp_path):
    spec = ClusterSpec(
        model=str(tiny_dirs["llama"]),
        num_prefill=1,
        num_decode=1,
        block_size=BS,
        kv_store=str(tmp_path / "kv"),
        buffer_bytes=8 << 20,
        cache_bytes=16 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
        speculative_config=json.dumps(SPEC),
    )
    reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=30, n=2)
    with LocalCluster(spec, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        try:
            for p in PROMPTS[:2]:
                assert client.generate(p, params).token_ids == reference.generate(p, params)[0].token_ids
                assert [r.token_ids for r in client.generate_choices(p, seeded)] == [
                    o.token_ids for o in reference.generate(p, seeded)
                ]
            stats = client.stats()
        finally:
            client.close()
    counts = stats["speculative"]["decode-0"]
    assert counts["accepted"] > 0 and counts["drafted"] >= counts["accepted"]
    assert f'engine_spec_decode_accepted_tokens_total{{engine="decode-0"}} {float(counts["accepted"])}' in render(stats)
