"""The names requests may give the served model: its served name, its aliases (``--served-model-name``'s others) and
the LoRA adapters (``--lora-modules``, and those loaded at runtime), each a model of its own in ``/v1/models``."""

from __future__ import annotations

import time

from dualpath.core.lora import adapter_table
from dualpath.serving.choices import ApiError


class ServedModels:
    """The served names. Only the admin routes change the adapters (``add`` and ``remove``, on the event loop);
    requests already submitted under a removed adapter keep its identity."""

    def __init__(self, front):
        self.front = front  # its ``cfg`` read when used (tests may replace it)
        cfg = front.cfg
        self.created = int(time.time())
        self.adapters = adapter_table(cfg.lora_modules, (cfg.model_name, *cfg.model_aliases))  # name -> identity
        self.adapter_dirs = {m.name: m.path for m in cfg.lora_modules}  # name -> PEFT directory (``/v1/models``)

    @property
    def cfg(self):
        return self.front.cfg

    def names(self) -> tuple[str, ...]:
        """Every name, the served one first."""
        return (self.cfg.model_name, *self.cfg.model_aliases, *self.adapters)

    def check(self, name: str) -> None:
        """A 404 unless ``name`` is served."""
        if name not in self.names():
            names = " or ".join(repr(n) for n in self.names())
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {names}",
                param="model",
                code="model_not_found",
            )

    def reply_name(self, asked: str) -> str:
        """The ``model`` a reply names: the adapter asked for (as vLLM names it), else the first served name."""
        return asked if asked in self.adapters else self.cfg.model_name

    def adapter_id(self, name: str) -> str:
        """The identity of the adapter ``name`` runs under ("" for the base model: ``SamplingParams.adapter``)."""
        return self.adapters.get(name, "")

    def card(self, name: str) -> dict:
        card = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "dualpath",
            "root": self.cfg.model_dir,  # vLLM's: what each served name is
            "parent": None,
            "max_model_len": self.cfg.max_model_len,  # which clients size prompts by
        }
        if name in self.adapter_dirs:  # vLLM's card of a LoRA adapter: its directory, and the model it adapts
            card.update(root=self.adapter_dirs[name], parent=self.cfg.model_name)
        return card

    def add(self, name: str, identity: str, path: str) -> None:
        self.adapters[name], self.adapter_dirs[name] = identity, path

    def remove(self, name: str) -> None:
        del self.adapters[name], self.adapter_dirs[name]
