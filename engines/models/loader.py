"""Reading a Hugging Face checkpoint directory: ``config.json`` and single or sharded ``*.safetensors``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from dualpath.core.config import ModelConfig, WeightQuantConfig
from dualpath.core.errors import CheckpointError

log = logging.getLogger(__name__)

_DIGEST_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class Cut:
    """The part ``[start, stop)`` of dimension ``dim`` of a checkpoint tensor that one tensor-parallel rank reads."""

    dim: int
    start: int
    stop: int

    def of_scales(self, block: tuple[int, int] | None) -> "Cut":
        """The same part of the tensor's block scales (``block``: rows, columns of a scale block); the cut falls on
        block edges (``CausalLM._check`` refuses one that does not)."""
        if block is None:
            return self
        b = block[0] if self.dim == 0 else block[1]
        return Cut(self.dim, self.start // b, -(-self.stop // b))


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory, parsed but not loaded. Tensors are read lazily, one at a time. ``quantize_at_load``:
    the files are plain, and the linear weights are quantized to ``config.quant`` as the model loads them (vLLM's
    ``--quantization fp8``; ``dualpath.engines.models.fp8``)."""

    path: Path
    hf_config: dict
    config: ModelConfig
    weight_files: tuple[Path, ...]
    quantize_at_load: bool = False

    @cached_property
    def tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the file holding it."""
        return {name: f for name, (f, _, _) in self._headers.items()}

    @cached_property
    def _headers(self) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
        """Tensor name -> (file, safetensors dtype such as ``BF16`` or ``F8_E4M3``, shape), each file's header read
        once."""
        out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for f in self.weight_files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    t = sf.get_slice(name)
                    out[name] = (f, t.get_dtype(), tuple(t.get_shape()))
        return out

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._headers[name][2]

    def tensor_dtype(self, name: str) -> str:
        return self._headers[name][1]

    def read_tensor(self, name: str, cut: Cut | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its part ``cut`` (read through safetensors' slices: a tensor-parallel rank never
        holds the whole tensor in host memory)."""
        with safe_open(str(self.tensor_files[name]), framework="pt") as sf:
            if cut is None:
                return sf.get_tensor(name)
            index = [slice(None)] * len(self.tensor_shape(name))
            index[cut.dim] = slice(cut.start, cut.stop)
            return sf.get_slice(name)[tuple(index)]

    @cached_property
    def weights_digest(self) -> str:
        """A cheap identity of the weights: every file's header, size and sampled data bytes.

        Fine-tunes of one base model share headers and sizes but not bytes, so sampled data tells them apart
        without hashing hundreds of gigabytes.
        """
        h = hashlib.blake2b(digest_size=16)
        for f in self.weight_files:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                header_len = struct.unpack("<Q", fh.read(8))[0]
                h.update(fh.read(header_len))
                data_start = 8 + header_len
                for pos in (data_start, data_start + (size - data_start) // 2, size - _DIGEST_SAMPLE_BYTES):
                    fh.seek(max(data_start, pos))
                    h.update(fh.read(_DIGEST_SAMPLE_BYTES))
            h.update(str(size).encode())
        return h.hexdigest()


def _weight_files(path: Path) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = tuple(sorted({path / f for f in weight_map.values()}))
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{path}: shards named in the index are missing: {missing}")
        return files
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def open_checkpoint(model_dir: str | os.PathLike, quantize: WeightQuantConfig | None = None) -> Checkpoint:
    """``model_dir`` parsed. ``quantize``: a checkpoint without ``quantization_config`` is served in that format,
    its linear weights quantized at load; a quantized one is served as it is stored."""
    path = Path(model_dir).expanduser()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: not a checkpoint directory (no config.json)")
    try:
        hf = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
    config = ModelConfig.from_hf(hf)
    config = dataclasses.replace(config, eos_token_ids=_end_tokens(config.eos_token_ids, path))
    at_load = quantize is not None and config.quant is None
    if at_load:
        config = dataclasses.replace(config, quant=quantize)
    return Checkpoint(
        path=path, hf_config=hf, config=config, weight_files=_weight_files(path), quantize_at_load=at_load
    )


def _end_tokens(eos: tuple[int, ...], path: Path) -> tuple[int, ...]:
    """``config.json``'s end tokens and ``generation_config.json``'s, in that order, each once: what generation
    stops at, as transformers' ``generate`` and vLLM take it (Llama 3's and Qwen2.5's instruct checkpoints name
    their end-of-turn token only there, so a reply would otherwise run past it)."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return eos
    try:
        more = json.loads(gen_file.read_text()).get("eos_token_id")
        more = [int(t) for t in (more if isinstance(more, list) else [] if more is None else [more])]
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{gen_file}: not a JSON object with integer eos_token_id(s) ({e})") from None
    return tuple(dict.fromkeys([*eos, *more]))
