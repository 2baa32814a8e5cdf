"""The decode roofline's byte counts (``decode_roofline.py``): what one decode step of a dense Llama-family model
must read, and the time that takes at a measured bandwidth. Pure arithmetic over a ``ModelConfig``, so that
``tests/docs/test_gpu_e2e.py`` checks it against a hand count without importing the bench."""

from __future__ import annotations

from dualpath.core.config import ModelConfig

DTYPE_BYTES = 2  # bfloat16 weights and KV


def weight_bytes(c: ModelConfig, dtype_bytes: int = DTYPE_BYTES) -> int:
    """Bytes of weights one decode step reads: every layer's q, k, v, o, gate, up and down projections and its two
    norms, the final norm, and the LM head (the embedding when tied). The embedding table is not counted when
    untied: a step gathers only its batch's rows."""
    if c.mla is not None or c.moe is not None:
        raise ValueError("weight_bytes counts dense Llama-family models only")
    h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    return dtype_bytes * (c.num_layers * layer + h + c.vocab_size * h)


def kv_bytes(c: ModelConfig, batch: int, context: float, dtype_bytes: int = DTYPE_BYTES) -> int:
    """Bytes of KV one decode step reads: K and V of every cached token of every sequence, in every layer."""
    return int(batch * context * c.num_layers * c.kv_elems_per_token * dtype_bytes)


def bound_seconds(weights: int, kv: int, copy_bps: float) -> float:
    """The roofline: a step reads its weights and KV once, at the measured copy bandwidth."""
    return (weights + kv) / copy_bps
