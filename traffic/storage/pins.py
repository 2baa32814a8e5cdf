"""Pins: blocks kept against eviction until a time, one file per agent session.

An agent session that asks for a TTL (``SessionHint.ttl_s``) has its stored blocks pinned: the scheduler writes
``<root>/<fingerprint>/pins/<session key>.pin`` (a magic, the expiry as Unix seconds, then the packed block
hashes), and every store that evicts from that directory (``FsStorage._evict``, in any engine process of any node
sharing it) skips the pinned blocks until the pin expires. A pin file is replaced whole (written aside, renamed),
so a reader sees one pin or the other; an expired one is removed by whoever reads it next. The scheduler bounds
what a tenant may pin (``SchedulerConfig.session_pin_quota_tokens``).
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Sequence

from dualpath.core.geometry import HASH_BYTES, BlockHash

PIN_DIR = "pins"
_MAGIC = b"DPPIN1\0\0"
_HEAD = struct.Struct("<8sd")


def pin_path(model_dir: Path, name: str) -> Path:
    if not name.isalnum():
        raise ValueError(f"a pin's name is alphanumeric (a session key), got {name!r}")
    return Path(model_dir) / PIN_DIR / f"{name}.pin"


def write_pin(model_dir: Path, name: str, keys: Sequence[BlockHash], until: float) -> None:
    """Pin ``keys`` until ``until`` (Unix seconds), replacing the pin of that name."""
    path = pin_path(model_dir, name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(_HEAD.pack(_MAGIC, until) + b"".join(keys))
    os.replace(tmp, path)


def remove_pin(model_dir: Path, name: str) -> None:
    pin_path(model_dir, name).unlink(missing_ok=True)


def pinned_keys(model_dir: Path, now: float | None = None) -> set[BlockHash]:
    """Every block pinned now under ``model_dir``; expired and unreadable pins are removed."""
    now = time.time() if now is None else now
    out: set[BlockHash] = set()
    pins = Path(model_dir) / PIN_DIR
    if not pins.is_dir():
        return out
    for f in pins.glob("*.pin"):
        try:
            data = f.read_bytes()
        except OSError:
            continue  # (removed meanwhile)
        magic, until = _HEAD.unpack_from(data) if len(data) >= _HEAD.size else (b"", 0.0)
        body = data[_HEAD.size :]
        if magic != _MAGIC or until <= now or len(body) % HASH_BYTES:  # (pins are replaced whole: never torn)
            f.unlink(missing_ok=True)
            continue
        out.update(body[i : i + HASH_BYTES] for i in range(0, len(body), HASH_BYTES))
    return out
