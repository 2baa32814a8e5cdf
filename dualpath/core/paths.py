"""Where the project keeps files by default: ``$DUALPATH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dualpath``, else
``~/.cache/dualpath``."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


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


def parse_size(text: str) -> int:
    """Bytes from ``"20G"``, ``"20GB"``, ``"512MiB"`` or ``"1000"`` (K, M, G, T: powers of 1000; Ki, Mi, Gi, Ti:
    of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 20G, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def auto_store_capacity(root: Path | str) -> int:
    """A KV store's default cap: half of what it could hold, i.e. of the disk's free space plus what the store
    already holds (a KV store grows with every token served: unbounded, it fills the disk)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    held = sum(f.stat().st_size for f in root.rglob("*.kv") if f.is_file())
    return (shutil.disk_usage(root).free + held) // 2
