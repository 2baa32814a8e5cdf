"""``dualpath quantize``: a checkpoint whose linear weights are block-scaled FP8, in the format DeepSeek and Qwen
release theirs (``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size``; a float32
``<name>_scale_inv`` beside each e4m3 weight), which dualpath, transformers, vLLM and SGLang load.

What is quantized is what the model reads as linear weights (``WeightSpec.fp8``): attention and MLP projections and
experts. Embeddings, the LM head, norms, routers and tensors the model does not read stay as they were.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from dualpath.core.errors import CheckpointError


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    block: tuple[int, int] = (128, 128),
    progress: bool = True,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Write the FP8 form of checkpoint ``src`` to the new directory ``dst`` (atomically: a crash leaves nothing
    there) and return it: every file but the weights copied, the weights in shards of about ``shard_bytes``."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from dualpath.core.config import WeightQuantConfig
    from dualpath.engines.models import MODEL_CLASSES, open_checkpoint
    from dualpath.engines.models.fp8 import SCALE_SUFFIX
    from dualpath.kernels.fp8 import quantize_blocks

    ckpt, dst = open_checkpoint(src), Path(dst)
    if ckpt.config.quant is not None:
        raise CheckpointError(f"{ckpt.path}: already quantized")
    if dst.exists():
        raise CheckpointError(f"{dst}: exists; quantize writes a new directory")
    WeightQuantConfig(block=tuple(block))  # refuses a block the kernels cannot tile
    model = MODEL_CLASSES[ckpt.config.architecture](ckpt.config)  # on the meta device: its specs, no memory
    linear = {name for spec in model.weight_specs() if spec.fp8 for name, _ in spec.sources}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for f in ckpt.path.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name in tqdm(
            sorted(ckpt.tensor_files), desc=f"quantizing {ckpt.path.name}", unit="tensor", disable=not progress
        ):
            t = ckpt.read_tensor(name)
            out = (
                dict(zip((name, name + SCALE_SUFFIX), quantize_blocks(t, tuple(block))))
                if name in linear
                else {name: t}
            )
            nbytes = sum(v.numel() * v.element_size() for v in out.values())
            if size and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1].update(out)
            size += nbytes
        _write_shards(shards, tmp, save_file)
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        (tmp / "config.json").write_text(json.dumps(dict(ckpt.hf_config, quantization_config=quant), indent=1))
        tmp.rename(dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _write_shards(shards: list[dict], out: Path, save_file) -> None:
    """One ``model.safetensors``, or Hugging Face's numbered shards and their index."""
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(v.numel() * v.element_size() for v in shard.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
