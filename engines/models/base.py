"""The layerwise model interface and checkpoint weight loading shared by every architecture.

A forward is driven one layer at a time by the caller (the model runner, or the prefill engine that waits for
each layer's KV to arrive): ``begin`` once per batch, ``forward_layer`` per layer, ``compute_logits`` at the end.
Models hold no KV and no per-request state; the caller owns where KV comes from and where it goes.
"""

from __future__ import annotations

import hashlib
import logging
import re
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from types import EllipsisType
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dualpath.core.config import ModelConfig
from dualpath.core.errors import CheckpointError, RequestError
from dualpath.core.geometry import HeadShard
from dualpath.engines.lora import AdapterRows, LoraWeights, Target, load_adapter
from dualpath.engines.models.fp8 import (
    SCALE_SUFFIX,
    Fp8Param,
    joins_stored_fp8,
    read_plain,
    scaled,
    source_problems,
    stays_fp8,
)
from dualpath.engines.models.loader import Checkpoint, Cut
from dualpath.engines.comm import TPShard
from dualpath.kernels.attention import CachedRows
from dualpath.kernels.fp8 import fp8_linear, quantize_blocks
from dualpath.kernels.norm import rms_norm
from dualpath.kernels.rope import rope_cos_sin, rope_inv_freq

log = logging.getLogger(__name__)

# Checkpoint tensors no architecture here uses: rotary caches, and DeepSeek's multi-token-prediction layers.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$)|(^model\.layers\.(\d+)\.)")


@dataclass(frozen=True)
class ForwardBatch:
    """One forward's shape: sequence i has ``cached_lens[i]`` cached tokens then ``new_lens[i]`` new ones, and runs
    under the LoRA adapter ``adapters[i]`` (its identity; "" or no ``adapters`` at all: the base model)."""

    cached_lens: tuple[int, ...]
    new_lens: tuple[int, ...]
    adapters: tuple[str, ...] = ()

    def __post_init__(self):
        if (
            len(self.cached_lens) != len(self.new_lens)
            or any(n < 1 for n in self.new_lens)
            or len(self.adapters) not in (0, len(self.new_lens))
        ):
            raise ValueError(
                f"bad forward batch: cached {self.cached_lens}, new {self.new_lens}, adapters {self.adapters}"
            )

    def adapter_rows(self) -> list[tuple[str, np.ndarray]]:
        """Each adapter the batch uses and the indices of its sequences' new tokens in the packed batch."""
        rows: dict[str, list[np.ndarray]] = {}
        start = 0
        for adapter, n in zip(self.adapters, self.new_lens):
            if adapter:
                rows.setdefault(adapter, []).append(np.arange(start, start + n))
            start += n
        return [(a, np.concatenate(r)) for a, r in rows.items()]

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)

    def positions(self) -> np.ndarray:
        """Every new token's position (int32), in a fixed number of array operations whatever the batch: a prefill
        of 16K tokens and a decode step of 64 sequences each take microseconds."""
        lens = np.asarray(self.new_lens)
        starts = np.cumsum(lens) - lens  # where each sequence's tokens begin in the batch
        return (np.arange(lens.sum()) + np.repeat(np.asarray(self.cached_lens) - starts, lens)).astype(np.int32)

    def last_token_indices(self) -> list[int]:
        out, end = [], 0
        for n in self.new_lens:
            end += n
            out.append(end - 1)
        return out


@dataclass
class ForwardContext:
    """Per-batch values every layer shares, computed once in ``begin`` so that no layer copies anything between
    host and device: each sequence's number of new tokens, the rotary cos/sin of every new token, and on the
    device each sequence's cached length and the prefix sums of the new lengths (where its new tokens start)."""

    new_lens: tuple[int, ...]
    cos: torch.Tensor
    sin: torch.Tensor
    cached_lens: torch.Tensor  # [B] int32
    cu_new: torch.Tensor  # [B + 1] int32
    lora: tuple[
        AdapterRows, ...
    ] = ()  # the rows each LoRA adapter in the batch changes (dualpath.engines.lora.add_lora)
    max_seen: int | None = None  # the most tokens a query sees (cached + new); None: unknown on the host


@dataclass(frozen=True)
class WeightSpec:
    """Our parameter ``param`` is built from checkpoint tensors ``sources`` (name, expected shape) by ``op``:
    ``copy`` (one source), ``cat`` (concatenate along dim 0) or ``stack`` (new leading dim; item i is the
    concatenation of sources ``i × per_item`` onwards, e.g. an expert's gate and up projections). ``fp8``: the
    model reads it only through ``linear``, ``add_linear`` or the MoE, so FP8 sources may stay FP8
    (``dualpath.engines.models.fp8``). ``cuts``: under tensor parallelism, the part of each source this rank reads (None:
    all of it; empty: no source is cut); the shapes in ``sources`` stay the checkpoint's."""

    param: str
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    op: str = "copy"
    per_item: int = 1
    fp8: bool = False
    cuts: tuple[Cut | None, ...] = ()

    def cut_of(self, name: str, block: tuple[int, int] | None = None) -> Cut | None:
        """The cut of source ``name``, or of its FP8 scales (``name`` ending in the scale suffix, ``block``: the
        scale blocks)."""
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        for (n, _), cut in zip(self.sources, self.cuts):
            if n == base and cut is not None:
                return cut.of_scales(block) if base != name else cut
        return None


def _joined(spec: WeightSpec, parts: list[torch.Tensor]) -> Iterator[tuple[int | EllipsisType, torch.Tensor]]:
    """``spec``'s parameter from checkpoint tensors, as (where in the parameter, its value): a stack item by item
    (no second copy of all experts), anything else whole (``...``)."""
    if spec.op != "stack":
        yield ..., parts[0] if spec.op == "copy" else torch.cat(parts)
        return
    for i in range(0, len(parts), spec.per_item):
        item = parts[i : i + spec.per_item]
        yield i // spec.per_item, item[0] if len(item) == 1 else torch.cat(item)


@torch.no_grad()
def _assemble(spec: WeightSpec, parts: list[torch.Tensor], target: torch.Tensor) -> None:
    """Fill ``target`` from checkpoint tensors."""
    for at, value in _joined(spec, parts):
        target[at].copy_(value)


@torch.no_grad()
def _quantize_into(spec: WeightSpec, parts: list[torch.Tensor], target: Fp8Param) -> None:
    """Fill FP8 ``target`` from plain checkpoint tensors, each joined part (a stack item) quantized on the target's
    device (what it gives does not depend on the device: one float32 division and one rounding per element)."""
    for at, value in _joined(spec, parts):
        q, scale = quantize_blocks(value.to(target.q.device), target.block)
        target.q[at].copy_(q)
        target.scale[at].copy_(scale)


def _misaligned_cuts(spec: WeightSpec, ckpt: Checkpoint, held_fp8: bool) -> list[str]:
    """A cut of a block-scaled source must fall on its scale blocks (else this rank's blocks would not be the
    checkpoint's, or TP 1's when quantized at load): each such cut that does not, with the numbers."""
    quant = ckpt.config.quant
    if quant is None:
        return []
    out = []
    for (name, shape), cut in zip(spec.sources, spec.cuts):
        if cut is None or not (held_fp8 or stays_fp8(spec, ckpt) or scaled(ckpt, name)):
            continue
        b = quant.block[0] if cut.dim == len(shape) - 2 else quant.block[1]
        if cut.start % b or cut.stop % b:
            out.append(
                f"tensor {name}'s tensor-parallel part [{cut.start}, {cut.stop}) of dim {cut.dim} does not "
                f"fall on its {b}-element FP8 scale blocks; serve it at a tensor-parallel size that does"
            )
    return out


def param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """A parameter on the meta device; real storage comes with ``to_empty`` before weights load."""
    return nn.Parameter(torch.empty(*shape, device="meta", dtype=dtype), requires_grad=False)


def linear(
    x: torch.Tensor, w: torch.Tensor | Fp8Param, b: torch.Tensor | None = None, backend: str = "torch"
) -> torch.Tensor:
    """``x @ w^T + b``; an FP8 weight on ``backend``'s kernel (``dualpath.kernels.fp8``)."""
    if isinstance(w, Fp8Param):
        return fp8_linear(x, w.weight, b, backend)
    return F.linear(x, w, b)


def add_linear(
    residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor | Fp8Param, b: torch.Tensor | None, backend: str
) -> torch.Tensor:
    """``residual + linear(x, w, b)``. On the fused path ("triton"), without a bias or with an FP8 weight (whose
    kernel adds the bias too), the sum is the GEMM's own epilogue (``addmm_``, beta = 1: one rounding, no add
    kernel), written over ``residual``: callers pass a residual stream no one else holds. The torch reference rounds
    the product, then the sum, as transformers."""
    if isinstance(w, Fp8Param):
        return fp8_linear(x, w.weight, b, backend, residual)
    if backend == "triton" and b is None:
        return residual.addmm_(x, w.t())
    return residual + linear(x, w, b)


class CausalLM(nn.Module, ABC):
    """A decoder-only model with a layerwise forward over externally held KV."""

    def __init__(self, config: ModelConfig, kernels: str = "torch", shard: TPShard = TPShard()):
        super().__init__()
        self.config = config
        self.kernels = kernels  # "torch" or "triton": the backend every layer's attention runs on
        # tensor parallelism: this rank's part; ``comm`` (set before the first forward when ``shard.size > 1``)
        # reduces the row-parallel layers' partial sums and gathers the vocabulary-parallel logits
        self.shard, self.comm = shard, None
        self.vocab = shard.split(config.vocab_size, "vocab_size")  # this rank's rows of the embedding and LM head
        inv_freq, self.rope_attention_factor = rope_inv_freq(config.rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        part = self.vocab[1] - self.vocab[0]
        self.embed_tokens = param(part, config.hidden_size)
        self.norm = param(config.hidden_size)
        if not config.tie_word_embeddings:
            self.lm_head = param(part, config.hidden_size)
        self.adapters: dict[str, LoraWeights] = {}  # identity -> weights (``add_adapter``)
        self.dp = None  # data-parallel attention: this engine's group (``dualpath.engines.parallel.dp.attach``)

    # --- forward -----------------------------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> ForwardContext:
        """The batch's shared values; its integers (the adapters' rows too) reach the device in one copy."""
        if self.dp is not None:
            self.dp.begin_forward()
        t, b = batch.num_tokens, len(batch.new_lens)
        lora = batch.adapter_rows() if any(batch.adapters) else []  # most steps: the base model alone
        ints = np.concatenate(
            [
                batch.positions(),
                np.array(batch.cached_lens, dtype=np.int32),
                np.cumsum([0, *batch.new_lens], dtype=np.int32),
                *[rows.astype(np.int32) for _, rows in lora],
            ]
        )
        dev = torch.from_numpy(ints).to(self.embed_tokens.device)
        ctx = self._context(dev[:t], batch.new_lens, dev[t : t + b], dev[t + b : t + 2 * b + 1])
        ctx.max_seen = max(c + n for c, n in zip(batch.cached_lens, batch.new_lens))
        at = t + 2 * b + 1
        for adapter, rows in lora:
            ctx.lora += (AdapterRows(self._adapter(adapter), dev[at : at + len(rows)] if len(rows) < t else None),)
            at += len(rows)
        return ctx

    def begin_decode(self, positions: torch.Tensor) -> ForwardContext:
        """``begin`` for one new token per sequence at ``positions`` already on the device (a CUDA graph's static
        input): no host work. A decode token's position is its sequence's cached length."""
        if self.dp is not None:
            self.dp.begin_forward()
        n = positions.shape[0]
        cu = torch.arange(n + 1, dtype=torch.int32, device=positions.device)
        return self._context(positions, (1,) * n, positions.to(torch.int32), cu)

    def _context(self, positions, new_lens, cached_lens, cu_new) -> ForwardContext:
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.rope_attention_factor, self.embed_tokens.dtype)
        return ForwardContext(tuple(new_lens), cos, sin, cached_lens, cu_new)

    # --- LoRA adapters -----------------------------------------------------------------------------------
    def lora_targets(self) -> dict[str, Target] | None:
        """PEFT target module name -> where it lands in this architecture; None: no adapters for it."""
        return None

    def add_adapter(self, path) -> str:
        """Load the PEFT LoRA adapter at ``path`` (``CheckpointError`` if it does not fit this model); returns its
        identity, which requests name it by (``SamplingParams.adapter``)."""
        targets = self.lora_targets()
        if targets is None:
            raise CheckpointError(f"{path}: LoRA adapters are not supported for {self.config.architecture} models")
        weights = load_adapter(path, targets, self.config.num_layers, self.embed_tokens.device, self.embed_tokens.dtype)
        self.adapters[weights.digest] = weights
        return weights.digest

    def check_adapter(self, adapter: str) -> None:
        """``RequestError`` unless a request with this adapter identity can run here."""
        if adapter and adapter not in self.adapters:
            raise RequestError(
                f"this engine has no LoRA adapter {adapter[:12]} (its files differ from what the "
                f"frontend read, or the engine was started without it)",
                field="model",
            )

    def _adapter(self, adapter: str) -> LoraWeights:
        self.check_adapter(adapter)
        return self.adapters[adapter]

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step has no data-dependent host work, so it can be captured as a CUDA graph: on the
        Triton kernels (the torch reference reads lengths on the host, and its MoE asks which experts run)."""
        return self.kernels == "triton"

    @property
    def kv_shard(self) -> HeadShard | None:
        """Which KV heads this rank's cache rows hold (None: the whole canonical row, e.g. MLA's latent)."""
        return None

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of one token's KV row in this rank's cache."""
        return self.config.kv_elems_per_token if self.kv_shard is None else self.kv_shard.local_elems

    def connect(self, comm, dispatch: str = "all_to_all") -> None:
        """Join the engine's ranks (tensor-parallel size > 1): this model's reductions and gathers, and its MoE
        blocks' (``dispatch``: how tokens reach experts under expert parallelism), go over ``comm``."""
        self.comm = comm
        for module in self.modules():
            if module is not self and hasattr(module, "connect"):
                module.connect(comm, dispatch)

    @contextmanager
    def forward_pass(self, batch: ForwardBatch) -> Iterator[ForwardContext]:
        """``begin``, and the end of the forward, whole or part way (data-parallel attention: its missing MoE
        exchanges run idle, so the group's engines stay in step)."""
        try:
            yield self.begin(batch)
        finally:
            if self.dp is not None:
                self.dp.settle()

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial ``x`` (a row-parallel layer's output), in place; ``x`` itself at TP 1."""
        return self.comm.all_reduce(x) if self.shard.size > 1 else x

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(token_ids, self.embed_tokens)
        lo, hi = self.vocab  # vocabulary-parallel: each rank looks up its rows, zeros elsewhere, then the sum
        mine = (token_ids >= lo) & (token_ids < hi)
        rows = F.embedding((token_ids - lo).clamp_(0, hi - lo - 1), self.embed_tokens)
        return self.reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    @abstractmethod
    def forward_layer(
        self, layer: int, hidden: torch.Tensor, ctx: ForwardContext, cached_kv: CachedRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run layer ``layer`` on the new tokens' hidden states ``[T, hidden]``.

        ``cached_kv`` holds each sequence's cached KV rows of this layer: a list of ``[C_i, kv_elems]`` tensors
        (C_i may be 0), or a ``PagedKV`` view of a paged cache. Returns the next hidden states and the new
        tokens' KV rows of this layer ``[T, kv_elems]``, packed like ``hidden``.
        """

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over the given rows, in float32."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps, self.kernels)
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        logits = F.linear(h, head).float()
        return logits if self.shard.size == 1 else self.comm.all_gather(logits)  # every rank: the whole vocabulary

    @torch.inference_mode()
    def forward_all(
        self,
        token_ids: torch.Tensor,
        batch: ForwardBatch,
        cached_kv: Sequence[Sequence[torch.Tensor]] | None = None,
        all_logits: bool = False,
    ):
        """Every layer in one call: ``(logits, new_kv per layer)``; logits of each sequence's last token unless
        ``all_logits``. ``cached_kv[layer][i]`` as in ``forward_layer``; None means nothing cached."""
        with self.forward_pass(batch) as ctx:
            hidden = self.embed(token_ids)
            empty = [hidden.new_empty(0, self.kv_elems_per_token)] * len(batch.new_lens)
            new_kv = []
            for layer in range(self.config.num_layers):
                hidden, kv = self.forward_layer(layer, hidden, ctx, cached_kv[layer] if cached_kv else empty)
                new_kv.append(kv)
        rows = hidden if all_logits else hidden[batch.last_token_indices()]
        return self.compute_logits(rows), new_kv

    # --- weights -----------------------------------------------------------------------------------------
    def weight_specs(self) -> Iterator[WeightSpec]:
        c, rows = self.config, (Cut(0, *self.vocab),) if self.shard.size > 1 else ()
        yield WeightSpec("embed_tokens", (("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)),), cuts=rows)
        yield WeightSpec("norm", (("model.norm.weight", (c.hidden_size,)),))
        if not c.tie_word_embeddings:
            yield WeightSpec("lm_head", (("lm_head.weight", (c.vocab_size, c.hidden_size)),), cuts=rows)

    def load_checkpoint(self, ckpt: Checkpoint, device: torch.device | str) -> None:
        """Allocate real storage and fill every parameter from ``ckpt``, checking names and shapes.

        Parameters keep the dtypes they were given (``cast_``) before loading, but those a block-scaled FP8
        checkpoint lets stay FP8 (``dualpath.engines.models.fp8.stays_fp8``), which become ``Fp8Param`` modules. Every
        problem is collected first, so one error lists all missing and misshapen tensors.
        """
        self._check(ckpt)
        for spec in self.weight_specs():
            if stays_fp8(spec, ckpt):
                self._hold_fp8(spec.param, ckpt.config.quant.block)
        self.to_empty(device=device)
        self.inv_freq = rope_inv_freq(self.config.rope)[0].to(device)
        self._fill(ckpt)

    @torch.no_grad()
    def reload_weights(self, ckpt: Checkpoint) -> str:
        """Copy ``ckpt``'s weights over the loaded ones, in place: every tensor keeps its storage, so CUDA graphs
        captured over them stay valid. Every name and shape is checked before anything is copied (a mismatch
        leaves the old weights whole). Returns a sha256 of every byte read, the weights' exact identity (of this
        rank's part under tensor parallelism: ``dualpath.engines.parallel.steps.update_weights`` joins the ranks')."""
        self.check_checkpoint(ckpt)
        digest = hashlib.sha256()
        self._fill(ckpt, digest)
        return digest.hexdigest()

    def check_checkpoint(self, ckpt: Checkpoint) -> None:
        """``_check``, with unreadable files (before anything was copied) a ``CheckpointError`` too."""
        try:
            self._check(ckpt)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged header
            raise CheckpointError(f"{ckpt.path}: cannot read its tensors ({e})") from None

    def _check(self, ckpt: Checkpoint) -> None:
        """Raise ``CheckpointError`` listing every tensor the model needs that ``ckpt`` lacks or shapes otherwise
        (their FP8 scales included; a parameter already held FP8 needs FP8 sources); warn about tensors it has that
        nothing uses."""
        available = ckpt.tensor_files
        used: set[str] = set()
        problems: list[str] = []
        for spec in self.weight_specs():
            held_fp8 = isinstance(self._target(spec.param), Fp8Param)
            for name, shape in spec.sources:
                used.update((name, name + SCALE_SUFFIX))
                if name not in available:
                    problems.append(f"missing tensor {name}")
                elif (got := ckpt.tensor_shape(name)) != shape:
                    problems.append(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
                elif held_fp8 and not scaled(ckpt, name) and not ckpt.quantize_at_load:
                    problems.append(f"tensor {name} is not FP8 (no {name}{SCALE_SUFFIX}) but the model holds it in FP8")
                else:
                    problems += source_problems(ckpt, name, shape)
            problems += _misaligned_cuts(spec, ckpt, held_fp8)
        if problems:
            head = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointError(f"{ckpt.path}: checkpoint does not match {self.config.architecture}: {head}")
        if self.shard.size == 1:  # a rank reads only its experts: the others' are no surprise
            self._warn_unused(set(available) - used)

    def _target(self, param: str) -> torch.Tensor | Fp8Param:
        """What a ``WeightSpec.param`` names: a parameter, or the ``Fp8Param`` that took its place."""
        module, _, name = param.rpartition(".")
        return getattr(self.get_submodule(module), name)

    def _hold_fp8(self, param: str, block: tuple[int, int]) -> None:
        """Put an ``Fp8Param`` of parameter ``param``'s shape where it stood (before storage is allocated)."""
        module, _, name = param.rpartition(".")
        owner = self.get_submodule(module)
        shape = tuple(getattr(owner, name).shape)
        delattr(owner, name)
        setattr(owner, name, Fp8Param(shape, block))

    def _fill(self, ckpt: Checkpoint, digest=None) -> None:
        """Read every source tensor (feeding its name and bytes to ``digest``) and assemble the parameters: an
        ``Fp8Param`` from the FP8 values and their scales where they join as stored, else quantized from the
        joined plain (or dequantized) sources; any other parameter from plain or dequantized sources."""

        block = ckpt.config.quant.block if ckpt.config.quant else None

        def read(name: str) -> torch.Tensor:
            cut = spec.cut_of(name, block)
            t = ckpt.read_tensor(name, cut)
            if digest is not None:
                digest.update(f"{name}:{cut}:{t.dtype}:{list(t.shape)};".encode())
                digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            return t

        for spec in self.weight_specs():
            target, names = self._target(spec.param), [name for name, _ in spec.sources]
            if isinstance(target, Fp8Param) and joins_stored_fp8(spec, ckpt):
                _assemble(spec, [read(n) for n in names], target.q)
                _assemble(spec, [read(n + SCALE_SUFFIX) for n in names], target.scale)
            elif isinstance(target, Fp8Param):
                _quantize_into(spec, [read_plain(ckpt, n, read) for n in names], target)
            else:
                _assemble(spec, [read_plain(ckpt, n, read) for n in names], target)

    def _warn_unused(self, unused: set[str]) -> None:
        surprising = []
        for name in unused:
            m = _IGNORED.search(name)
            if m and (m.group(1) or int(m.group(3)) >= self.config.num_layers):
                continue
            surprising.append(name)
        if surprising:
            log.warning(
                "checkpoint has %d tensors the model does not use, e.g. %s", len(surprising), sorted(surprising)[:3]
            )

    def cast_(self, dtype: torch.dtype) -> "CausalLM":
        """Cast floating parameters to ``dtype``, keeping those pinned to float32 (routers) as they are."""
        keep = set(self.float32_params())
        for name, p in self.named_parameters():
            if name not in keep and p.dtype.is_floating_point:
                p.data = p.data.to(dtype)
        return self

    def float32_params(self) -> Sequence[str]:
        return ()
