"""Tiny random checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3, DeepSeek-V3.2) built through Hugging Face
transformers, for tests.

Each is a real checkpoint directory: ``config.json``, safetensors weights (optionally sharded), a byte-level
``tokenizer.json`` (every byte is a token, plus ChatML specials) and a chat template. transformers is only
needed here, to build them; loading them needs nothing but this project.
"""

from __future__ import annotations

import json
from pathlib import Path

from dualpath.checkpoints.chatml import CHATML_TEMPLATE, END_OF_TEXT, IM_END, IM_START

TINY_VOCAB = 320
SPECIALS = (END_OF_TEXT, IM_START, IM_END)  # ids 256, 257, 258
EOS_ID = 258


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (one token per byte, no merges) with ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": IM_END,
                "pad_token": END_OF_TEXT,
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 4096,
            },
            indent=1,
        )
    )


def _hf_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=256,
    )
    if arch == "llama":
        cfg = dict(
            common,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
        return transformers.LlamaConfig(**{**cfg, **overrides})
    if arch == "qwen2":
        cfg = dict(
            common,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        return transformers.Qwen2Config(**{**cfg, **overrides})
    if arch in ("qwen3", "qwen3_moe"):  # head_dim apart from hidden_size / heads, as Qwen3's models have it
        cfg = dict(
            common,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=arch == "qwen3",
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        if arch == "qwen3":
            return transformers.Qwen3Config(**{**cfg, **overrides})
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )  # layer 1 keeps a dense MLP
        return transformers.Qwen3MoeConfig(**{**cfg, **overrides})
    if arch in ("deepseek_v3", "deepseek_v32"):
        cfg = dict(
            common,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_routed_experts=8,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            v_head_dim=24,
            qk_nope_head_dim=16,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
        if arch == "deepseek_v3":
            return transformers.DeepseekV3Config(**{**cfg, **overrides})
        # An indexer that keeps 16 tokens, so tests' prompts of a few dozen tokens attend sparsely. Where scores
        # tie at the cut transformers' topk picks any (our kernel the earliest), so ties are made rare: 16 heads
        # (a key scores exactly 0 when all of them score it below zero), and no pad token (whose embedding row
        # transformers zeroes: all of its query's scores would be 0)
        cfg.update(index_n_heads=16, index_head_dim=32, index_topk=16, pad_token_id=None)
        return transformers.DeepseekV32Config(**{**cfg, **overrides})
    raise ValueError(f"unknown tiny architecture {arch!r}")


def build_tiny_checkpoint(
    path: str | Path,
    arch: str,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    **overrides,
) -> Path:
    """Write a tiny random ``arch`` checkpoint to ``path`` and return it. Deterministic for a given seed and device.
    ``overrides`` change the Hugging Face config (benchmarks build ~1B- and 8B-parameter ones this way); ``device``
    is where the weights are drawn (a GPU draws billions of parameters in seconds, a CPU in minutes)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _hf_config(arch, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if arch.startswith("deepseek"):  # random correction biases with enough spread that routing
        # exercises them and bfloat16 rounding does not flip expert choices
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_byte_tokenizer(path)
    return path


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_adapter(
    path: str | Path,
    base: str | Path,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = LORA_TARGETS,
    rslora: bool = False,
    std: float = 0.1,
) -> Path:
    """Write a random PEFT LoRA adapter for the Llama-family checkpoint ``base`` (its files as PEFT saves them)
    and return its directory. B is random too (PEFT starts it at zero, a no-op), so the adapter changes every
    logit; deterministic for a given seed."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, base = Path(path), Path(base)
    path.mkdir(parents=True, exist_ok=True)
    shapes = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key in sorted(shapes):
        parts = key.split(".")
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[4] in targets and parts[5] == "weight":
            out, inp = shapes[key]
            stem = f"base_model.model.{key[: -len('.weight')]}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * std
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
                "r": rank,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "target_modules": list(targets),
                "bias": "none",
                "use_rslora": rslora,
                "use_dora": False,
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "rank_pattern": {},
                "alpha_pattern": {},
                "inference_mode": True,
            },
            indent=1,
        )
    )
    return path
