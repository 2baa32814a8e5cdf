"""MoE models across an engine's ranks on CPU (gloo): routed experts sliced (tensor parallelism) or whole on each rank
(expert parallelism, tokens dispatched by all-to-all or all-gather), MLA attention heads split over a latent every
rank holds.

Greedy tokens equal one rank's and logits agree within 1e-4 (float32: the same terms summed in another order); the
dispatch backends give a one-process reference's sums within 1e-5, with the same tokens on every rank (tensor-
parallel attention) or each rank's own (data-parallel attention, a rank with none included); bad sizes are refused
before any process starts; a rank killed mid-generation fails the engine at once, never a hang.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.core.config import EngineConfig, ParallelConfig
from dualpath.core.errors import ConfigError, RankLostError
from dualpath.engines.models import open_checkpoint
from dualpath.engines.experts import ExpertMap
from dualpath.engines.parallel.ranks import check_parallel

PROMPTS = [[1, 5, 9, 22, 7, 3] * 3, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 8]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LOGITS_TOL = 1e-4


def _llm(model, n=1, **kw) -> LLM:
    return LLM(str(model), num_kv_blocks=64, block_size=16, tensor_parallel_size=n, **kw)


def _same(model, n, ref_kw=None, **kw) -> None:
    ref = _llm(model, **(ref_kw or {}))
    want, want_logits = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)], ref.logits(PROMPTS[1])
    with _llm(model, n, **kw) as tp:
        assert [o.token_ids for o in tp.generate(PROMPTS, GREEDY)] == want
        assert (tp.logits(PROMPTS[1]) - want_logits).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("qwen3_moe", {"enable_expert_parallel": True}),
        # MLA + EP: deepseek_v32 below runs it by default (with all_gather dispatch)
        pytest.param("deepseek_v3", {"enable_expert_parallel": True}, marks=pytest.mark.slow),
        pytest.param("deepseek_v3", {}, marks=pytest.mark.slow),  # plain TP of MLA + MoE: tests/cluster TP tests
        ("deepseek_v32", {"enable_expert_parallel": True, "moe_dispatch": "all_gather"}),
    ],
)
def test_moe_models_at_two_ranks_give_one_ranks_tokens(tiny_dirs, arch, kw):
    """Qwen3-MoE (softmax routing, a dense layer), DeepSeek-V3 (grouped routing, shared experts, dense first layer,
    MLA heads split) and V3.2 (its indexer whole on every rank: the prompt of 80 tokens attends sparsely); experts
    whole per rank by all-to-all or all-gather, or each expert sliced."""
    _same(tiny_dirs[arch], 2, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_moe_models_at_four_ranks(tiny_dirs, arch):
    """2 experts per rank, by all-to-all (20 s on 2 cores: the slow run)."""
    _same(tiny_dirs[arch], 4, enable_expert_parallel=True)


@pytest.mark.slow  # ~3.5 s; the bf16 expert-parallel cases stay in the default run
def test_fp8_experts_under_expert_parallelism(tmp_path):
    """Quantized at load: each rank's experts are whole, so their scale blocks are TP 1's and so are the tokens."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint(
        tmp_path / "m",
        "qwen3_moe",
        hidden_size=512,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=2,
    )
    assert open_checkpoint(model).config.moe is not None
    _same(model, 2, ref_kw={"quantization": "fp8"}, quantization="fp8", enable_expert_parallel=True)


def test_bad_expert_parallelism_is_refused_before_any_process_starts(tiny_dirs):
    config = open_checkpoint(tiny_dirs["qwen3_moe"]).config
    six = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=6))
    with pytest.raises(ConfigError, match=r"routed experts .* \(6\)"):
        check_parallel(six, EngineConfig(parallel=ParallelConfig(4, enable_expert_parallel=True)))
    narrow = dataclasses.replace(config, moe=dataclasses.replace(config.moe, moe_intermediate_size=30))
    with pytest.raises(ConfigError, match=r"moe_intermediate_size .*\(30\)"):
        check_parallel(narrow, EngineConfig(parallel=ParallelConfig(4)))
    check_parallel(narrow, EngineConfig(parallel=ParallelConfig(4, enable_expert_parallel=True)))  # whole experts
    with pytest.raises(ConfigError, match="6 routed experts do not divide among 4"):
        ExpertMap(6, 0, 4)
    with pytest.raises(ConfigError, match="moe_dispatch"):
        ParallelConfig(2, moe_dispatch="deepep")


def test_a_rank_killed_mid_generation_fails_the_engine_at_once(tiny_dirs):
    """Rank 1 dies while the ranks exchange tokens step after step: the generation raises ``RankLostError`` naming
    the rank within seconds (the collectives fail at once; their timeout bounds a hung rank)."""
    with _llm(tiny_dirs["qwen3_moe"], 2, enable_expert_parallel=True) as tp:
        outcome: list = []

        def generate():
            try:
                tp.generate(PROMPTS * 4, SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
                outcome.append("finished")
            except RankLostError as e:
                outcome.append(e)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(tp.ranks.procs[0].pid, signal.SIGKILL)
        thread.join(15)
        assert not thread.is_alive() and time.monotonic() - killed < 15
        assert isinstance(outcome[0], RankLostError) and "rank 1" in str(outcome[0])


# --- the dispatch backends, on their own ------------------------------------------------------------------------
_WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from dualpath.engines.comm import Comm
    from dualpath.engines.experts import ExpertMap, make_dispatch
    rank, size, kind, replicated, store, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", \\
        sys.argv[5], sys.argv[6]
    rank, size = int(rank), int(size)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    comm = Comm(rank, size, dist.group.WORLD, dist.group.WORLD, store)
    g = torch.Generator().manual_seed(0)
    mats = torch.randn(6, 16, 16, generator=g)  # expert e: x -> x @ mats[e]
    counts = [7] * size if replicated else [5, 0, 9, 3][:size]
    inputs = [(torch.randn(n, 16, generator=g), torch.rand(n, 2, generator=g),
               torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(n)]) if n else
               torch.zeros(0, 2, dtype=torch.long)) for n in counts]
    x, w, ids = inputs[0] if replicated else inputs[rank]
    experts = ExpertMap(6, rank, size)
    compute = lambda xs, local, wt: torch.bmm(xs[:, None], mats[local + experts.first])[:, 0] * wt[:, None]
    got = make_dispatch(kind, comm, experts, replicated).routed(x, w, ids, compute)
    want = sum(torch.bmm(x[:, None], mats[ids[:, j]])[:, 0] * w[:, j:j + 1] for j in range(2))
    torch.save((got, want), out)
    dist.barrier()
    dist.destroy_process_group()
""")


# all_gather also runs by default through deepseek_v32's two ranks (test_moe_models_at_two_ranks_give_one_ranks_tokens)
@pytest.mark.parametrize("kind", ["all_to_all", pytest.param("all_gather", marks=pytest.mark.slow)])
@pytest.mark.parametrize("replicated", [pytest.param(True, marks=pytest.mark.slow), False])
def test_dispatch_backends_give_the_one_process_sums(kind, replicated, tmp_path):
    """Three ranks, 2 experts each; the same 7 tokens (each rank dispatches 3, 2 and 2 of them), or their own 5,
    none (a rank with no requests still takes part) and 9. (The same tokens on every rank run in the MoE models'
    tests of the default run too; here, in the slow run.)"""
    size, store = 3, tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                str(r),
                str(size),
                kind,
                "1" if replicated else "0",
                str(store),
                str(tmp_path / f"out{r}"),
            ],
            env=env,
        )
        for r in range(size)
    ]
    for p in procs:
        assert p.wait(60) == 0
    for r in range(size):
        got, want = torch.load(tmp_path / f"out{r}")
        assert got.shape == want.shape
        if want.numel():
            assert (got - want).abs().max().item() < 1e-5
