"""Bad checkpoints fail with an error that names the problem."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dualpath.core.errors import CheckpointError
from dualpath.engines.models import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tmp_path, tiny_dirs):
    d = _copy(tiny_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(d)


def test_missing_tensor_is_named(tmp_path, tiny_dirs):
    d = _copy(tiny_dirs["qwen2"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(d)


def test_mismatched_shape_is_named(tmp_path, tiny_dirs):
    d = _copy(tiny_dirs["deepseek_v3"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.2.mlp.experts.3.up_proj.weight"] = torch.zeros(31, 64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight has shape \[31, 64\], expected \[32, 64\]"):
        load_model(d)


def test_not_a_checkpoint_and_no_weights(tmp_path, tiny_dirs):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    d = _copy(tiny_dirs["llama"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(d)


def test_missing_config_field_and_quantized(tmp_path, tiny_dirs):
    d = _copy(tiny_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match=r"quantized checkpoints \(awq\) are not supported"):
        load_model(d)


@pytest.mark.parametrize("body", ['{"eos_token_id": ["x"]}', "[1, 2]", '{"eos_token_id": {"a": 1}}', "{not json"])
def test_a_bad_generation_config_is_named(tmp_path, tiny_dirs, body):
    d = _copy(tiny_dirs["llama"], tmp_path / "m")
    (d / "generation_config.json").write_text(body)
    with pytest.raises(CheckpointError, match="generation_config.json: not a JSON object with integer eos"):
        load_model(d)
