"""Our layerwise models against Hugging Face transformers on the same checkpoints (float32)."""

import numpy as np
import pytest
import torch

from archs import ARCHS
from dualpath.core.geometry import KVGeometry
from dualpath.engines.models import ForwardBatch, load_model
from dualpath.kernels.kv_move import layer_tokens_from_full, pack_full_blocks

LENS = (5, 23, 41)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    import transformers

    return {
        a: transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[a], dtype=torch.float32).eval() for a in ARCHS
    }


def prompts(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in LENS]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_logits_match_transformers(arch, tiny_dirs, hf_models):
    model = load_model(tiny_dirs[arch])
    seqs = prompts(0)
    ours, _ = model.forward_all(torch.cat(seqs), ForwardBatch((0,) * 3, LENS), all_logits=True)
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf_models[arch](s[None]).logits[0]
        assert rel_err(ours[start : start + len(s)], ref) < 1e-4
        start += len(s)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_reuse_through_full_block_bytes(arch, tiny_dirs):
    """KV of the leading whole blocks, serialized to Full Block bytes and sliced back into Layer Blocks, serves
    as cached KV for the rest of the prompt: the rest's logits equal the one-shot forward."""
    model = load_model(tiny_dirs[arch])
    geom = KVGeometry.for_model(model.config, "float32", block_size=16)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (40, 57, 33)]
    one_shot, kv = model.forward_all(
        torch.cat(seqs), ForwardBatch((0,) * 3, tuple(len(s) for s in seqs)), all_logits=True
    )
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    cached_per_seq, rest_lens, expected = [], [], []
    for i, s in enumerate(seqs):
        n_hit = geom.num_full_blocks(len(s)) * geom.block_size
        seq_kv = [layer_kv[offsets[i] : offsets[i] + n_hit] for layer_kv in kv]
        stored = bytes(pack_full_blocks(seq_kv, geom).numpy().tobytes())  # what storage holds
        loaded = torch.frombuffer(bytearray(stored), dtype=torch.uint8).view(-1, geom.full_block_bytes)
        cached_per_seq.append([layer_tokens_from_full(loaded, l, geom) for l in range(geom.num_layers)])
        rest_lens.append(len(s) - n_hit)
        expected.append(one_shot[offsets[i] + n_hit : offsets[i + 1]])
    cached = [[cached_per_seq[i][l] for i in range(3)] for l in range(geom.num_layers)]
    rest_ids = torch.cat([s[len(s) - r :] for s, r in zip(seqs, rest_lens)])
    hits = tuple(len(s) - r for s, r in zip(seqs, rest_lens))
    logits, _ = model.forward_all(rest_ids, ForwardBatch(hits, tuple(rest_lens)), cached, all_logits=True)
    assert rel_err(logits, torch.cat(expected)) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(arch, tiny_dirs, hf_models):
    from dualpath import LLM, SamplingParams

    llm = LLM(str(tiny_dirs[arch]), block_size=16)
    seqs = prompts(1)
    outs = llm.generate([s.tolist() for s in seqs], SamplingParams(temperature=0, max_tokens=48))
    for s, out in zip(seqs, outs):
        with torch.no_grad():
            ref = (
                hf_models[arch]
                .generate(
                    s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), max_new_tokens=48, do_sample=False
                )[0, len(s) :]
                .tolist()
            )
        assert out.token_ids == ref


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_dirs):
    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    sharded = build_tiny_checkpoint(tmp_path / "sharded", "llama", seed=1, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_model(sharded), load_model(tiny_dirs["llama"])
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_stays_close(arch, tiny_dirs):
    ref = load_model(tiny_dirs[arch])
    bf = load_model(tiny_dirs[arch], dtype="bfloat16")
    ids = prompts(2)[2]
    if arch == "deepseek_v32":  # past index_topk (16) a rounding can flip the tokens a query attends to: there
        ids = ids[:16]  # transformers' own bfloat16 logits differ from its float32 ones by 8%
    a, _ = ref.forward_all(ids, ForwardBatch((0,), (len(ids),)), all_logits=True)
    b, _ = bf.forward_all(ids, ForwardBatch((0,), (len(ids),)), all_logits=True)
    assert rel_err(b, a) < 2e-2


def test_qwen3_moe_layouts_and_unnormalized_routing_match_transformers(tmp_path):
    """Qwen3-MoE as its own config.json spells it (``num_experts``, which transformers 5 saves as
    ``num_local_experts``): experts on every second layer (``decoder_sparse_step``) but one in ``mlp_only_layers``,
    routing weights left unnormalized (``norm_topk_prob`` false, Qwen3-30B-A3B's published default)."""
    import json

    import transformers

    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    d = build_tiny_checkpoint(
        tmp_path / "moe",
        "qwen3_moe",
        seed=2,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
    )
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(d)
    assert [model.config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert model.config.moe.num_experts == 8 and not model.config.moe.norm_topk_prob
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = prompts(4)[1]
    ours, _ = model.forward_all(ids, ForwardBatch((0,), (len(ids),)), all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(ours, ref) < 1e-4


def test_a_sliding_window_bounds_the_context_served(tmp_path, tiny_dirs):
    """Mistral's sliding window: within it full attention is the model's attention, so contexts up to the window
    are served (the default limit) and a longer ``max_model_len`` is refused, naming the window."""
    import json
    import shutil

    from dualpath import LLM
    from dualpath.core.errors import CheckpointError, ConfigError

    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "mistral")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64})
    )
    assert LLM(str(d), block_size=16).engine.max_model_len == 64
    assert LLM(str(d), block_size=16, max_model_len=48).engine.max_model_len == 48
    with pytest.raises(ConfigError, match="exceeds the model's sliding window of 64 tokens"):
        LLM(str(d), block_size=16, max_model_len=128)
    (d / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None})
    )
    assert LLM(str(d), block_size=16).engine.max_model_len == cfg["max_position_embeddings"]
    (d / "config.json").write_text(json.dumps({**cfg, "layer_types": ["sliding_attention"] * 3}))
    with pytest.raises(CheckpointError, match="sliding-window attention"):
        load_model(d)
