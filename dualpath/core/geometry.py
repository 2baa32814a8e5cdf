"""The one owner of KV block geometry and block identity.

Units (``shared/DESIGN.md`` §2):
- a *token block* is ``block_size`` tokens; only full blocks have an identity (a chained hash);
- a *Layer Block* is one layer's KV of one block: ``block_size × token_bytes`` bytes, token-major, each token's
  row being that layer's KV elements (GQA/MHA: K heads then V heads; MLA: latent then rope key);
- a *Full Block* is the Layer Blocks of every layer, layer-major and contiguous, so layer ``l`` is the byte
  range ``[l × layer_block_bytes, (l+1) × layer_block_bytes)``.

Every other module derives sizes and offsets from ``KVGeometry``; nothing else multiplies these numbers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dualpath.core.config import KV_DTYPE_BYTES, ModelConfig
from dualpath.core.errors import ConfigError

KV_LAYOUT_VERSION = 1
HASH_BYTES = 16

BlockHash = bytes


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    block_size: int
    kv_elems_per_token: int
    dtype: str

    def __post_init__(self):
        if self.dtype not in KV_DTYPE_BYTES:
            raise ConfigError(f"unknown KV dtype {self.dtype!r}")
        if min(self.num_layers, self.block_size, self.kv_elems_per_token) < 1:
            raise ConfigError(f"degenerate KV geometry {self}")

    @classmethod
    def for_model(cls, model: ModelConfig, dtype: str, block_size: int) -> "KVGeometry":
        return cls(model.num_layers, block_size, model.kv_elems_per_token, dtype)

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV in one layer."""
        return self.kv_elems_per_token * self.dtype_bytes

    @property
    def layer_block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def layer_block_shape(self) -> tuple[int, int]:
        """Element shape of a Layer Block: ``(block_size, kv_elems_per_token)``."""
        return (self.block_size, self.kv_elems_per_token)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of ``layer`` inside a Full Block."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        return layer * self.layer_block_bytes

    def layer_range(self, first: int, last: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of layers ``[first, last)`` inside a Full Block."""
        if not 0 <= first < last <= self.num_layers:
            raise IndexError(f"layer range [{first}, {last}) outside [0, {self.num_layers}]")
        return first * self.layer_block_bytes, (last - first) * self.layer_block_bytes

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` (the last one possibly partial)."""
        return -(-num_tokens // self.block_size)

    def budget_blocks(self, budget_bytes: int, resident_layers: int) -> int:
        """Token blocks ``budget_bytes`` of memory holds when each keeps ``resident_layers`` layers of KV resident
        (a prefill batch: every layer for basic prefill, two for layerwise)."""
        return budget_bytes // (resident_layers * self.layer_block_bytes)


LAYERWISE_RESIDENT_LAYERS = 2  # a layerwise prefill keeps the layer computing and the next one arriving resident


@dataclass(frozen=True)
class HeadShard:
    """Which KV heads tensor-parallel rank ``rank`` of ``size`` holds, and where they sit in a canonical Layer Block
    row ``[K (num_kv_heads × head_dim) | V (num_kv_heads × head_dim)]``. Storage, DRAM buffers and transfers keep that
    row whatever the parallelism, so engines of different sizes share blocks; a rank's device cache holds its own
    row ``[K (local) | V (local)]``. With fewer KV heads than ranks each head is replicated on ``size /
    num_kv_heads`` ranks (vLLM's rule); the first of them (``primary``) writes it back."""

    num_kv_heads: int
    head_dim: int
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        n, s = self.num_kv_heads, self.size
        if not 0 <= self.rank < s or (n % s if n >= s else s % n):
            raise ConfigError(f"{n} KV heads cannot be split among {s} ranks (one must divide the other)")

    @classmethod
    def replicated(cls, elems: int, rank: int = 0, size: int = 1) -> "HeadShard":
        """The whole row on every rank, rank 0 writing it back: MLA's latent (one KV "head" that tensor-parallel
        attention heads all read), seen as one head of ``elems / 2`` K and V elements."""
        if elems % 2:
            raise ConfigError(f"a KV row of {elems} elements cannot be replicated as one head (odd)")
        return cls(1, elems // 2, rank, size)

    @property
    def num_local(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def local_elems(self) -> int:
        return 2 * self.num_local * self.head_dim

    @property
    def first(self) -> int:
        """The first KV head this rank holds."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.num_local
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def primary(self) -> bool:
        return self.num_kv_heads >= self.size or self.rank % (self.size // self.num_kv_heads) == 0

    @property
    def whole(self) -> bool:
        return self.num_local == self.num_kv_heads

    def local_geometry(self, g: "KVGeometry") -> "KVGeometry":
        return KVGeometry(g.num_layers, g.block_size, self.local_elems, g.dtype)

    def _heads(self, rows):
        """``rows [..., canonical elems]`` viewed ``[..., 2, num_kv_heads, head_dim]``, this rank's heads picked."""
        v = rows.view(*rows.shape[:-1], 2, self.num_kv_heads, self.head_dim)
        return v[..., self.first : self.first + self.num_local, :]

    def take(self, rows):
        """This rank's part of canonical rows ``[..., elems]``, as local rows ``[..., local elems]`` (a copy)."""
        return self._heads(rows).reshape(*rows.shape[:-1], self.local_elems)

    def put(self, rows, index, local):
        """Write local rows ``local [T, ..., local elems]`` into rows ``index`` of canonical ``rows [N, ..., elems]``."""
        self._heads(rows)[index] = local.view(*local.shape[:-1], 2, self.num_local, self.head_dim)


def choice_blocks(block_size: int, num_prompt_tokens: int, num_tokens: int, n: int) -> int:
    """Blocks ``n`` choices of one prompt hold at ``num_tokens`` tokens each (prompt included): the prompt's full
    blocks once (the choices share them), the rest (its partial block copied) once per choice."""
    shared = num_prompt_tokens // block_size
    return shared + n * (-(-num_tokens // block_size) - shared)


def model_fingerprint(
    model: ModelConfig, dtype: str, block_size: int, weights_digest: str, kv_dtype: str | None = None
) -> BlockHash:
    """Identity of everything that changes KV bytes: architecture, weights, dtype, KV dtype (None: ``dtype``),
    block size, layout.

    Two deployments share stored blocks only if their fingerprints are equal, so a block computed by another
    model, dtype or block size, or held in another KV dtype, can never be served as a hit.
    """
    fields = {
        "layout": KV_LAYOUT_VERSION,
        "model": model.to_dict(),
        "dtype": dtype,
        "block_size": block_size,
        "weights": weights_digest,
    }
    if kv_dtype not in (None, dtype):  # absent otherwise, so stores written before KV dtypes existed still hit
        fields["kv_dtype"] = kv_dtype
    payload = json.dumps(fields, sort_keys=True)
    return hashlib.blake2b(payload.encode(), digest_size=HASH_BYTES).digest()


def chain_root(fingerprint: BlockHash, salt: str = "", adapter: str = "") -> BlockHash:
    """What a prompt's chain starts from: the fingerprint, or for a salted request (vLLM's ``cache_salt``) a hash of
    it and the salt, personalized so that no token block's hash can equal it. Requests share stored blocks only if
    their salts are equal: a tenant's prompts never hit (so cannot be probed through) another tenant's. A request
    run under a LoRA adapter (``adapter``: its identity, ``dualpath.core.lora``) chains from a hash of that root and the
    identity under a personalization of its own: its KV, computed with other weights, is only its adapter's."""
    root = fingerprint
    if salt:
        root = hashlib.blake2b(root + salt.encode(), digest_size=HASH_BYTES, person=b"dualpath-salt").digest()
    if adapter:
        root = hashlib.blake2b(root + adapter.encode(), digest_size=HASH_BYTES, person=b"dualpath-lora").digest()
    return root


def block_hashes(
    token_ids: Sequence[int] | bytes,
    fingerprint: BlockHash,
    block_size: int,
    parent: BlockHash | None = None,
    salt: str = "",
    adapter: str = "",
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``: ``h_i = H(h_{i-1} || tokens_i)``, ``h_{-1}`` =
    ``chain_root(fingerprint, salt, adapter)``, each block's tokens as little-endian uint32s.

    ``token_ids``: the ids, or their bytes as packed for the wire (``pack_tokens``), hashed as they are (the
    scheduler hashes prompts as they were sent: no conversion to a list and back). A trailing partial block gets no
    hash. ``parent`` continues a chain whose earlier blocks were hashed already (then ``token_ids`` starts at a
    block boundary, and the salt and adapter are in ``parent`` already).
    """
    step = block_size * 4
    packed = isinstance(token_ids, bytes)
    n_full = len(token_ids) // (step if packed else block_size)
    if n_full == 0:
        return []
    if packed:
        raw = token_ids
    else:
        raw = np.asarray(token_ids[: n_full * block_size], dtype="<u4").tobytes()
    h = parent if parent is not None else chain_root(fingerprint, salt, adapter)
    out = []
    for i in range(n_full):
        h = hashlib.blake2b(h + raw[i * step : (i + 1) * step], digest_size=HASH_BYTES).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class FullBlockSlots:
    """A region of Full Block slots (a DRAM buffer, a storage read target): slot ``s``, layer ``l`` starts at
    ``s × full_block_bytes + l × layer_block_bytes``."""

    geometry: KVGeometry
    num_slots: int

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.geometry.full_block_bytes

    def offset(self, slot: int, layer: int) -> int:
        return slot * self.geometry.full_block_bytes + self.geometry.layer_offset(layer)


@dataclass(frozen=True)
class LayerMajorBlocks:
    """A region laid out ``[layers, num_blocks, block_size, kv_elems]`` (a paged device cache, or a layer
    workspace with ``num_layers = 1``): block ``b`` of layer ``l`` starts at ``(l × num_blocks + b) ×
    layer_block_bytes``."""

    geometry: KVGeometry
    num_blocks: int
    num_layers: int | None = None  # None: all of the geometry's layers

    @property
    def nbytes(self) -> int:
        return (self.num_layers or self.geometry.num_layers) * self.num_blocks * self.geometry.layer_block_bytes

    def offset(self, slot: int, layer: int) -> int:
        layer_index = layer if self.num_layers is None else layer % self.num_layers
        return (layer_index * self.num_blocks + slot) * self.geometry.layer_block_bytes


BlockLayout = FullBlockSlots | LayerMajorBlocks
