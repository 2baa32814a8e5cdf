"""An 8-bit float KV cache (``--kv-cache-dtype fp8``): the geometry, the options, whole models against a float64
reference that rounds its KV the same way, and the runtime's consistency (a token's output does not depend on
whether its keys were computed in this forward, earlier, or loaded from storage). The kernels' own fp8 tests are
in ``test_triton_kernels.py``."""

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.core.config import EngineConfig, ModelConfig
from dualpath.core.errors import ConfigError
from dualpath.core.geometry import KVGeometry, model_fingerprint
from dualpath.engines.models import load_model, open_checkpoint
from dualpath.engines.models.base import ForwardBatch

BS = 16


def test_the_options_and_the_geometry():
    assert EngineConfig(dtype="bfloat16").kv_dtype == "bfloat16"
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="fp8").kv_dtype == "float8_e4m3fn"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_dtype == "float8_e4m3fn"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float8_e4m3fn")  # a cache's dtype, not a model's
    bf16 = KVGeometry(num_layers=30, block_size=64, kv_elems_per_token=384, dtype="bfloat16")
    fp8 = KVGeometry(num_layers=30, block_size=64, kv_elems_per_token=384, dtype="float8_e4m3fn")
    assert fp8.token_bytes == 384 and 2 * fp8.full_block_bytes == bf16.full_block_bytes


def test_fingerprints_keep_kv_dtypes_apart_and_old_stores_valid(tiny_dirs):
    import json

    cfg = ModelConfig.from_hf(json.loads((tiny_dirs["llama"] / "config.json").read_text()))
    base = model_fingerprint(cfg, "bfloat16", 64, "w")
    assert model_fingerprint(cfg, "bfloat16", 64, "w", "bfloat16") == base  # the model's own: as before
    assert model_fingerprint(cfg, "bfloat16", 64, "w", "float8_e4m3fn") != base
    assert model_fingerprint(cfg, "float32", 64, "w", "float8_e4m3fn") != model_fingerprint(
        cfg, "bfloat16", 64, "w", "float8_e4m3fn"
    )


def test_the_option_reaches_every_engine():
    from dualpath.cli import build_parser, engine_config
    from dualpath.launcher import ClusterSpec, LocalCluster

    p = build_parser()
    base = ["engine", "--role", "decode", "--model", "m", "--scheduler", "h:1"]
    assert engine_config(p.parse_args(base + ["--kv-cache-dtype", "fp8"])).engine.kv_dtype == "float8_e4m3fn"
    assert engine_config(p.parse_args(base)).engine.kv_cache_dtype == "auto"
    for cmd in ("serve", "rollout", "generate"):
        assert "--kv-cache-dtype" in p._subparsers._group_actions[0].choices[cmd].format_help()
    cluster = LocalCluster.__new__(LocalCluster)
    cluster.spec, cluster.scheduler_address = ClusterSpec(model="m", kv_cache_dtype="fp8"), "h:1"
    args = cluster._engine_args("decode", 0, 0)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"


def float64_prompt_logprobs(model_dir, tokens: list[int]) -> torch.Tensor:
    """Each prompt token's logprob by a float64 copy of the model in one forward whose attention reads KV rounded
    to e4m3 (an empty e4m3 cache makes the reference round its new rows as the cache would)."""
    model = load_model(open_checkpoint(str(model_dir)), "cpu", torch.float64, "torch")
    empty = [[torch.empty(0, model.config.kv_elems_per_token, dtype=torch.float8_e4m3fn)]] * model.config.num_layers
    logits, _ = model.forward_all(torch.tensor(tokens), ForwardBatch((0,), (len(tokens),)), empty, all_logits=True)
    lps = torch.log_softmax(logits.double(), -1)
    return lps[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "deepseek_v32"])
def test_prompt_logprobs_against_a_float64_reference(tiny_dirs, arch):
    """Prefilled in chunks of 16 over an e4m3 paged cache: every prompt token's logprob equals the float64
    reference's within 1e-4 (seen: 9e-7; without the rounding the gap is ~5e-2)."""
    tokens = [(7 * i) % 200 + 3 for i in range(45)]
    llm = LLM(str(tiny_dirs[arch]), block_size=BS, max_num_batched_tokens=16, kv_cache_dtype="fp8")
    out = llm.generate(tokens, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]], dtype=torch.float64)
    want = float64_prompt_logprobs(tiny_dirs[arch], tokens)
    assert (got - want).abs().max() < 1e-4
    full = LLM(str(tiny_dirs[arch]), block_size=BS, max_num_batched_tokens=16)
    exact = full.generate(tokens, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    unrounded = torch.tensor([lp.logprob for lp in exact.prompt_logprobs[1:]], dtype=torch.float64)
    assert (unrounded - want).abs().max() > 1e-2  # the rounding is visible: the check above could fail


def test_decoded_tokens_see_what_a_prefill_of_them_sees(tiny_dirs):
    """A reply decoded token by token over the e4m3 cache, then the prompt and reply prefilled whole: the decode
    steps' logprobs equal the prefill's (1e-4), so a hit loaded from storage gives what computing it gives."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=BS, kv_cache_dtype="fp8")
    prompt = list(range(3, 40))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True))[0]
    again = llm.generate(prompt + out.token_ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    decoded = [lp.logprob for lp in out.logprobs]
    prefilled = [lp.logprob for lp in again.prompt_logprobs[len(prompt) :]]
    assert max(abs(a - b) for a, b in zip(decoded, prefilled)) < 1e-4


def test_gpus_without_e4m3_in_triton_are_refused_clearly(monkeypatch):
    from dualpath.kernels.attention import check_cache_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"compute capability 8.9 .*A100 is 8.0.*--kernels torch"):
        check_cache_dtype("triton", "cuda:0", torch.float8_e4m3fn)
    check_cache_dtype("torch", "cuda:0", torch.float8_e4m3fn)  # the reference reads it
    check_cache_dtype("triton", "cuda:0", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_cache_dtype("triton", "cuda:0", torch.float8_e4m3fn)  # an H100/H200
