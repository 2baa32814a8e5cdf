"""LoRA adapters as served models (vLLM's ``--lora-modules name=path``): names, identities and their checks.

An adapter is a PEFT directory: ``adapter_config.json`` and ``adapter_model.safetensors``. A request names it as
its ``model``; the frontend turns the name into the adapter's identity, a sha256 of both files' bytes
(``SamplingParams.adapter``), and everything below the frontend knows adapters only by identity. The identity
roots the request's KV chain (``dualpath.core.geometry.chain_root``): KV computed under one adapter's weights is never
a hit for the base model or another adapter, and an adapter whose files change after a restart starts a chain
of its own, as the store outlives every process. Torch-free: frontends and the scheduler import it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dualpath.core.errors import CheckpointError, ConfigError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT options that change the adapter's math in ways the engines do not compute: refused, never ignored
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "modules_to_save": "modules_to_save (fully trained layers)",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
    "trainable_token_indices": "trainable_token_indices",
}


@dataclass(frozen=True)
class LoraModule:
    """A served adapter: the ``model`` name requests give and its PEFT directory."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> "LoraModule":
        """``name=path`` (vLLM's ``--lora-modules`` form)."""
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"a LoRA module is name=path, got {text!r}")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class AdapterConfig:
    """What the engines take from an adapter's config: ``delta(x) = scale × B(A(x))`` on each target (the targets
    and ranks are read from the tensors themselves)."""

    scale: float


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """The adapter's config, or ``CheckpointError`` naming the file and what is wrong or not supported: never the
    values read (a runtime load's error goes back to an HTTP client, who should learn the rule, not the file)."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the LoRA adapter's config ({e})") from None
    if not isinstance(raw, dict) or str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise CheckpointError(f"{file}: not a LoRA adapter (its peft_type must be LORA)")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise CheckpointError(f"{file}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise CheckpointError(f"{file}: trained biases (a bias other than 'none') are not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise CheckpointError(f"{file}: r must be a positive integer and lora_alpha a number")
    return AdapterConfig(float(alpha / rank**0.5 if raw.get("use_rslora") else alpha / rank))


def adapter_digest(path: str | Path) -> str:
    """The adapter's identity: sha256 over its config's and weights' bytes (hex), or ``CheckpointError``."""
    digest = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        file = Path(path) / name
        try:
            with open(file, "rb") as f:
                digest.update(name.encode() + b"\0")
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read the LoRA adapter ({e.strerror or e})") from None
    return digest.hexdigest()


def adapter_table(modules: tuple[LoraModule, ...], served: tuple[str, ...]) -> dict[str, str]:
    """name -> identity of each module, checked: readable, names unique and none a name of the base model."""
    table: dict[str, str] = {}
    for m in modules:
        if m.name in table or m.name in served:
            raise ConfigError(f"LoRA module name {m.name!r} is given twice or names the base model")
        read_adapter_config(m.path)
        table[m.name] = adapter_digest(m.path)
    return table
