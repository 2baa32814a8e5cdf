"""A spy for host <-> device traffic made by the runtime's own code: calls that turn a tensor into host values
(``item``, ``tolist``, ``int(t)``, ...) or host values into a tensor (``torch.tensor``, ``torch.as_tensor``). On a
GPU each is a copy, and most wait for the device; on CPU they are free, so this is how CPU tests check that a
layer loop or a CUDA graph's step has none. Calls made by torch, Triton or the tests themselves are not counted.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[2])
_TO_HOST = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
_TO_DEVICE = ("tensor", "as_tensor")


@contextlib.contextmanager
def host_transfers():
    """Yields a list that collects ``(what, file, line)`` of every transfer our code makes inside the block."""
    seen: list[tuple[str, str, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        _spy(mp, seen)
        yield seen


def transfers_in_layers(monkeypatch: pytest.MonkeyPatch, model) -> list:
    """Watch every ``model.forward_layer`` call from now on: returns the list ``host_transfers`` fills inside them."""
    inside: list[tuple[str, str, int]] = []
    layers = model.forward_layer

    def layer(*a, **k):
        with host_transfers() as seen:
            out = layers(*a, **k)
        inside.extend(seen)
        return out

    monkeypatch.setattr(model, "forward_layer", layer)
    return inside


def _spy(mp: pytest.MonkeyPatch, seen: list) -> None:
    def note(name: str) -> None:
        caller = sys._getframe(2).f_code
        if caller.co_filename.startswith(ROOT) and "/tests/" not in caller.co_filename:
            seen.append((name, caller.co_filename, sys._getframe(2).f_lineno))

    for name in _TO_HOST:

        def method(self, *a, _orig=getattr(torch.Tensor, name), _name=name, **k):
            note(_name)
            return _orig(self, *a, **k)

        mp.setattr(torch.Tensor, name, method)
    for name in _TO_DEVICE:

        def factory(*a, _orig=getattr(torch, name), _name=name, **k):
            note(_name)
            return _orig(*a, **k)

        mp.setattr(torch, name, factory)
