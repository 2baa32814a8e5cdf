"""LoRA adapter weights on the device and their part of a forward.

An adapter's targets are folded onto the model's fused projections (q, k and v into ``qkv``; gate and up into
``gate_up``): per layer and fused projection one ``A`` ``[R, in]`` (the targets' A matrices stacked) and one ``B``
``[out, R]`` (theirs placed block-diagonally at each target's output rows, the scale folded in), so a projection's
delta is two small GEMMs whatever number of its parts the adapter trains. Rows of a batch take their own
sequence's adapter (``AdapterRows``): one batch mixes the base model and any number of adapters.

Under tensor parallelism an adapter is cut as its base layer (vLLM's rule): a column-parallel projection (qkv,
gate_up) keeps all of ``A`` and this rank's rows of ``B``; a row-parallel one (o, down) keeps this rank's columns
of ``A`` and all of ``B``, so its product is a partial sum that the layer's own all-reduce adds up
(``B(A x) = sum over ranks of B(A_r x_r)``): no collective of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dualpath.core.errors import CheckpointError
from dualpath.core.lora import ADAPTER_WEIGHTS, adapter_digest, read_adapter_config

# PEFT's tensor names: base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


@dataclass(frozen=True)
class Target:
    """Where a PEFT target module (``in_features -> out_features`` in the checkpoint) lands: our fused projection
    ``module``, from row ``start`` of this rank's part of it. ``rows``: this rank's rows of the target's output (a
    column-parallel cut of ``B``); ``cols``: this rank's columns of its input (a row-parallel cut of ``A``); None:
    all of them."""

    module: str
    start: int
    in_features: int
    out_features: int
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + (self.rows[1] - self.rows[0] if self.rows else self.out_features)

    def cut(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the checkpoint's ``(A [r, in], B [out, r])``."""
        if self.cols:
            a = a[:, self.cols[0] : self.cols[1]]
        if self.rows:
            b = b[self.rows[0] : self.rows[1]]
        return a, b


@dataclass
class LoraWeights:
    """One adapter on the device: ``layers[l][module] = (A, B)`` for each fused projection it changes."""

    digest: str
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class AdapterRows:
    """The rows of a batch (indices into its packed new tokens, on the device) that run under ``weights``; None:
    every row (no gather and scatter). ``mask`` (a captured decode step's, ``dualpath.engines.graphs``): every row is
    computed and its product scaled by ``mask [rows, 1]`` (1: the adapter's rows, 0: the others), so the step's
    shapes do not depend on which rows use the adapter."""

    weights: LoraWeights
    rows: torch.Tensor | None
    mask: torch.Tensor | None = None


def load_adapter(
    path: str | Path, targets: dict[str, Target], num_layers: int, device: torch.device, dtype: torch.dtype
) -> LoraWeights:
    """Read a PEFT LoRA adapter for a model whose target modules are ``targets``; ``CheckpointError`` naming the
    file for anything it cannot compute exactly (an unknown tensor, a shape that does not fit, DoRA...)."""
    from safetensors import safe_open

    cfg, file = read_adapter_config(path), Path(path) / ADAPTER_WEIGHTS
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or m.group(2) not in targets or int(m.group(1)) >= num_layers:
                    raise CheckpointError(
                        f"{file}: tensor {key} is not a LoRA matrix of this model's "
                        f"{', '.join(targets)} in layers 0-{num_layers - 1}"
                    )
                found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(key)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a missing or damaged file
        raise CheckpointError(f"{file}: cannot read the LoRA adapter's weights ({e})") from None
    if not found:
        raise CheckpointError(f"{file}: holds no LoRA matrices")
    layers: list[dict] = [{} for _ in range(num_layers)]
    for layer in range(num_layers):
        for module in dict.fromkeys(t.module for t in targets.values()):
            parts = [
                (name, found[layer, name])
                for name, t in targets.items()
                if t.module == module and (layer, name) in found
            ]
            if parts:
                layers[layer][module] = _fuse(file, layer, parts, targets, cfg.scale, device, dtype)
    return LoraWeights(adapter_digest(path), layers)


def _fuse(file, layer, parts, targets, scale, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused projection's ``(A [R, in], B [out, R])`` from its trained parts (B zero where a part is not)."""
    rank = 0
    for name, ab in parts:
        t, a, b = targets[name], ab.get("A"), ab.get("B")
        if (
            a is None
            or b is None
            or a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != t.in_features
            or b.shape != (t.out_features, a.shape[0])
        ):
            shapes = {k: list(v.shape) for k, v in ab.items()}
            raise CheckpointError(
                f"{file}: layer {layer} {name}: LoRA matrices {shapes} do not fit a "
                f"{t.in_features} -> {t.out_features} projection"
            )
        rank += a.shape[0]
    out = max(t.end for t in targets.values() if t.module == targets[parts[0][0]].module)
    cut = [targets[name].cut(ab["A"], ab["B"]) for name, ab in parts]
    a_all = torch.cat([a.to(torch.float32) for a, _ in cut])
    b_all = torch.zeros(out, rank, dtype=torch.float32)
    col = 0
    for (name, _), (a, b) in zip(parts, cut):
        t, r = targets[name], a.shape[0]
        b_all[t.start : t.end, col : col + r] = b.to(torch.float32) * scale
        col += r
    return a_all.to(device, dtype).contiguous(), b_all.to(device, dtype).contiguous()


def add_lora(
    out: torch.Tensor, x: torch.Tensor, adapters: tuple[AdapterRows, ...], layer: int, module: str
) -> torch.Tensor:
    """``out[rows] += B(A(x[rows]))`` for each adapter's rows that trains ``module`` in ``layer``; ``out`` must be
    the caller's own tensor (it is written in place). Rows without an adapter are untouched."""
    for ad in adapters:
        ab = ad.weights.layers[layer].get(module)
        if ab is None:
            continue
        if ad.rows is not None:
            out.index_add_(0, ad.rows, F.linear(F.linear(x.index_select(0, ad.rows), ab[0]), ab[1]))
        elif ad.mask is not None:  # other rows add their (finite) product times 0: exactly nothing
            out.addcmul_(F.linear(F.linear(x, ab[0]), ab[1]), ad.mask)
        else:
            out.add_(F.linear(F.linear(x, ab[0]), ab[1]))
    return out
