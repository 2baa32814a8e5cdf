"""Tensor-parallel engines on CPU (gloo): rank 0 in this process, the others ``dualpath.engines.parallel.ranks`` processes.

Greedy tokens at TP 2 and 4 are TP 1's, and logits agree within 1e-4 (float32: the reductions add the same
terms in another order); KV heads fewer than ranks are replicated; weights are read in slices; bad configurations
fail before any process starts; a dead rank fails the engine's next step at once, never a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from dualpath import LLM, SamplingParams
from dualpath.core.config import EngineConfig, ParallelConfig
from dualpath.core.errors import ConfigError, RankLostError
from dualpath.core.geometry import HeadShard
from dualpath.engines.models import open_checkpoint
from dualpath.engines.parallel.ranks import check_parallel

PROMPTS = [[1, 5, 9, 22, 7, 3] * 3, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 8]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LOGITS_TOL = 1e-4


def _tp(model, n, **kw) -> LLM:
    return LLM(str(model), num_kv_blocks=64, block_size=16, tensor_parallel_size=n, **kw)


def _same(model, n, params=GREEDY, **kw) -> None:
    ref = LLM(str(model), num_kv_blocks=64, block_size=16, **kw)
    want, want_logits = [o.token_ids for o in ref.generate(PROMPTS, params)], ref.logits(PROMPTS[1])
    with _tp(model, n, **kw) as tp:
        assert [o.token_ids for o in tp.generate(PROMPTS, params)] == want
        assert (tp.logits(PROMPTS[1]) - want_logits).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_tokens(tiny_dirs, arch):
    """Llama (2 KV heads), Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head q/k norms)."""
    _same(tiny_dirs[arch], 2)


def test_kv_heads_fewer_than_ranks_are_replicated():
    """2 KV heads on 4 ranks: each is held by two ranks, and only the first writes it back."""
    assert [HeadShard(2, 16, r, 4).first for r in range(4)] == [0, 0, 1, 1]
    assert [HeadShard(2, 16, r, 4).primary for r in range(4)] == [True, False, True, False]


@pytest.mark.slow
def test_four_ranks_replicate_kv_heads_fewer_than_ranks(tiny_dirs):
    """The tiny Llama has 2 KV heads: at TP 4 each is held by two ranks (15 s on 2 cores: the slow run)."""
    _same(tiny_dirs["llama"], 4)


@pytest.mark.slow  # (~7 s; TP steps, graphs, LoRA and weight updates run by default in this file)
def test_speculative_decoding_and_sampling_under_tp(tiny_dirs):
    """Prompt-lookup drafts verified in one forward, and seeded sampling (the generator lives on rank 0)."""
    _same(tiny_dirs["llama"], 2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    _same(tiny_dirs["qwen2"], 2, SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True))


def test_lora_adapters_are_cut_as_their_base_layers(tiny_dirs, tiny_adapters):
    """Column-parallel targets keep their rows of B, row-parallel ones their columns of A (whose partial products the
    layer's all-reduce adds up): one batch mixing the base model and two adapters gives TP 1's tokens, the adapter
    named at start-up and the one loaded by path on first use alike."""
    mods, path = {"sql": str(tiny_adapters["sql"])}, str(tiny_adapters["poet"])
    loras = [None, "sql", path]
    ref = LLM(str(tiny_dirs["llama"]), num_kv_blocks=64, block_size=16, lora_modules=mods)
    want = [o.token_ids for o in ref.generate([PROMPTS[1]] * 3, GREEDY, lora_request=loras)]
    assert len({tuple(w) for w in want}) == 3  # each adapter changes the reply
    with _tp(tiny_dirs["llama"], 2, lora_modules=mods) as tp:
        assert [o.token_ids for o in tp.generate([PROMPTS[1]] * 3, GREEDY, lora_request=loras)] == want
        assert set(tp.ranks.state.model.adapters) == {ref.adapters["sql"], ref.adapters[path]}


def test_a_bad_adapter_or_checkpoint_is_refused_on_every_rank_and_the_engine_serves_on(tiny_dirs, tmp_path):
    """A refusal is an error for the caller, not a dead rank: the engine's next step runs on every rank."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint
    from dualpath.core.errors import CheckpointError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    wide = build_tiny_checkpoint(tmp_path / "wide", "llama", seed=2, hidden_size=32)
    with _tp(tiny_dirs["llama"], 2) as tp:
        want = [o.token_ids for o in tp.generate(PROMPTS[:1], GREEDY)]
        with pytest.raises(CheckpointError, match="adapter"):
            tp.generate(PROMPTS[:1], GREEDY, lora_request=str(bad))
        with pytest.raises(CheckpointError, match="config differs"):
            tp.update_weights(str(wide))
        assert tp.ranks.lost is None and not tp.ranks.state.model.adapters
        assert [o.token_ids for o in tp.generate(PROMPTS[:1], GREEDY)] == want


def test_weight_updates_reach_every_rank(tiny_dirs, tmp_path):
    """New weights at TP 2 give what an engine started on them gives; the digest covers every rank's part (a
    change in rank 1's slice alone changes it)."""
    from safetensors.torch import load_file, save_file

    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    second = build_tiny_checkpoint(tmp_path / "second", "llama", seed=2)
    want = [o.token_ids for o in LLM(str(second), num_kv_blocks=64, block_size=16).generate(PROMPTS, GREEDY)]
    copy = shutil.copytree(tiny_dirs["llama"], tmp_path / "copy")
    with _tp(tiny_dirs["llama"], 2) as tp:
        first = tp.update_weights(str(tiny_dirs["llama"]))
        assert tp.update_weights(str(copy)) == first
        (file,) = copy.glob("*.safetensors")
        tensors = load_file(file)
        tensors["model.layers.1.mlp.down_proj.weight"][3, -1] += 1.0  # the last column: rank 1's slice of down_proj
        save_file(tensors, file, metadata={"format": "pt"})
        assert tp.update_weights(str(copy)) != first
        tp.update_weights(str(second))
        assert [o.token_ids for o in tp.generate(PROMPTS, GREEDY)] == want


def test_decode_graph_steps_run_on_every_rank(tiny_dirs):
    """Each rank replays its own decode graphs in step (here their static buffers run eagerly: capture needs
    CUDA); a rank without them would fail the step, so TP 1's tokens mean every rank ran its graphs."""
    ref = LLM(str(tiny_dirs["llama"]), num_kv_blocks=64, block_size=16)
    want = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    with _tp(tiny_dirs["llama"], 2) as tp:
        runner = tp.engine.runner
        runner.capture(4, 128, enforce_eager=False, capture=False)
        assert runner.graphs is not None and runner.graphs.fits(2, 8)
        runs = []
        real = runner._decode_graph
        runner._decode_graph = lambda *a: runs.append(1) or real(*a)
        assert [o.token_ids for o in tp.generate(PROMPTS, GREEDY)] == want
        assert len(runs) >= GREEDY.max_tokens - 1


def test_mistral_within_its_window_under_tp(tiny_dirs, tmp_path):
    """Mistral (the tiny Llama's weights under Mistral's config, a 128-token window) at TP 2."""
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "mistral")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 128})
    )
    assert open_checkpoint(d).config.sliding_window == 128
    _same(d, 2)


@pytest.mark.slow  # (~9 s; FP8 weights under TP by default: tests/engines/test_expert_parallel.py's FP8 experts)
def test_fp8_at_load_cuts_on_scale_blocks(tmp_path):
    """Quantized at load (block-scaled FP8, 128 x 128): each rank's parts fall on scale blocks, so its blocks are
    TP 1's and the tokens are too; a size whose parts would cut a block is refused with the numbers."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint(
        tmp_path / "m",
        "llama",
        hidden_size=512,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=2,
    )
    _same(model, 2, quantization="fp8")
    with pytest.raises(Exception, match="does not fall on its 128-element FP8 scale blocks"):
        _tp(model, 4, quantization="fp8")


def test_each_rank_holds_its_part_of_the_weights(tiny_dirs):
    """Rank 0 of 2 holds half the sharded weights; only the norms are whole on every rank."""
    whole = LLM(str(tiny_dirs["llama"]), num_kv_blocks=8, block_size=16).model
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    norms = sum(p.numel() * p.element_size() for n, p in whole.named_parameters() if "norm" in n)
    with _tp(tiny_dirs["llama"], 2) as tp:
        assert size(tp.model) == pytest.approx((size(whole) - norms) / 2 + norms, rel=1e-6)


def test_bad_configurations_fail_before_any_process_starts(tiny_dirs):
    with pytest.raises(ConfigError, match="attention heads"):
        check_parallel(open_checkpoint(tiny_dirs["llama"]).config, EngineConfig(parallel=ParallelConfig(3)))
    with pytest.raises(ConfigError, match="devices"):
        check_parallel(
            open_checkpoint(tiny_dirs["llama"]).config, EngineConfig(device="cuda:0", parallel=ParallelConfig(2))
        )
    with pytest.raises(ConfigError, match="master_port"):
        ParallelConfig(2, master_port=70000)


def test_a_dead_rank_fails_the_next_step_at_once(tiny_dirs):
    with _tp(tiny_dirs["llama"], 2) as tp:
        tp.generate(PROMPTS[:1], GREEDY)
        follower = tp.ranks.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(10)
        deadline = time.monotonic() + 10
        while tp.ranks.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 1" in tp.ranks.lost and "SIGKILL" in tp.ranks.lost
        start = time.monotonic()
        with pytest.raises(RankLostError, match="rank 1"):
            tp.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 5


# (~8 s each: the slow tier, with tests/cluster/test_tp_cluster.py's HTTP clusters of mixed sizes)
@pytest.mark.parametrize(
    "prefill_tp,decode_tp", [pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow)]
)
def test_a_cluster_of_mixed_parallelism_shares_kv_on_both_read_paths(tiny_dirs, tmp_path, prefill_tp, decode_tp):
    """1 prefill and 2 decode engines of different TP sizes: KV written by one parallelism (the decode engines
    store every full block; the prefill engine stages its heads' rows) and read by the other, by the prefill
    engine (PE path), through a decode engine's buffer (DE path) and split between them, gives TP 1's tokens."""
    from test_cluster import run_conversation, spec

    from dualpath.client import ClusterClient
    from dualpath.launcher import LocalCluster

    model = tiny_dirs["llama"]
    reference = LLM(str(model), block_size=16)
    with LocalCluster(
        spec(model, tmp_path / "kv", prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp),
        run_dir=str(tmp_path / "run"),
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        try:
            for mode in ("pe", "de", "split"):
                results = run_conversation(client, reference, seed=50 + len(mode), turns=3, mode=mode)
                assert [got.token_ids for _, got, _ in results] == [want for _, _, want in results], mode
                assert all(got.num_cached_tokens > 0 for _, got, _ in results[1:]), mode
        finally:
            client.close()
