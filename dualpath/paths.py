"""Where the project keeps files by default: ``$DUALPATH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dualpath``, else
``~/.cache/dualpath``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("DUALPATH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dualpath"


def default_kv_store() -> Path:
    return cache_dir() / "kv"


def default_models_dir() -> Path:
    return cache_dir() / "models"
