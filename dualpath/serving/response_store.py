"""Where the Responses API's stored responses live (for ``GET /v1/responses/{id}`` and ``previous_response_id``).

``DirectoryResponses`` keeps each response in a file of a directory every frontend mounts (by default beside the KV
store), so any frontend replica continues any conversation and a restart loses none: conversation state lives in
storage, as the KV does, never only in one process. ``MemoryResponses`` keeps them in the frontend's memory (one
frontend, nothing across restarts).

Each response belongs to its owner (``dualpath.serving.auth``: a tag of the API key that stored it): ``get`` and
``delete`` by another owner find nothing. Files are created readable by this user alone (0600, their directory
0700: conversations are the users'); a file written before owners were kept has the anonymous owner.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

Entry = tuple[dict, list[dict], list[dict]]  # the response object, the conversation's messages it ends, its input items
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # what the frontend makes: anything else was never stored
MAX_BYTES = 256 << 20  # the stored responses' bytes, all together, by default


class ResponseStore(ABC):
    """The frontend calls ``put`` once a stored response is complete, ``get`` for reads and continuations,
    ``delete`` for DELETE. Each keeps at most ``capacity`` responses and ``max_bytes`` of them (their JSON; the
    oldest go first, and a response larger than ``max_bytes`` alone is not kept), never raises for an id it does
    not hold, and may be called from several threads."""

    @abstractmethod
    def put(self, response: dict, conversation: list[dict], inputs: list[dict] = (), owner: str = "") -> None:
        """Keep ``response`` (its ``id``), the messages a later turn continues and the request's input items, as
        ``owner``'s."""

    @abstractmethod
    def get(self, rid: str, owner: str = "") -> Optional[Entry]:
        """The response, its conversation and its input items, or None (none kept, or another owner's)."""

    @abstractmethod
    def delete(self, rid: str, owner: str = "") -> bool:
        """Whether there was one of ``owner``'s to delete."""


def _record(response: dict, conversation: list[dict], inputs, owner: str) -> bytes:
    """A stored response as its file holds it (what its bytes are counted by, in memory too)."""
    return json.dumps(
        {"response": response, "conversation": conversation, "input": list(inputs), "owner": owner}
    ).encode()


class MemoryResponses(ResponseStore):
    """In this process, least recently used out first."""

    def __init__(self, capacity: int, max_bytes: int = MAX_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self.items: OrderedDict[str, tuple[str, Entry, int]] = OrderedDict()  # id -> owner, entry, bytes
        self.bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict], inputs: list[dict] = (), owner: str = "") -> None:
        size = len(_record(response, conversation, inputs, owner))
        if self.capacity <= 0 or size > self.max_bytes:
            return
        with self._lock:
            self._pop(response["id"])
            self.items[response["id"]] = (owner, (response, conversation, list(inputs)), size)
            self.bytes += size
            while len(self.items) > self.capacity or self.bytes > self.max_bytes:
                self._pop(next(iter(self.items)))

    def _pop(self, rid: str) -> bool:
        kept = self.items.pop(rid, None)
        if kept is not None:
            self.bytes -= kept[2]
        return kept is not None

    def get(self, rid: str, owner: str = "") -> Optional[Entry]:
        with self._lock:
            kept = self.items.get(rid)
            if kept is None or kept[0] != owner:
                return None
            self.items.move_to_end(rid)
            return kept[1]

    def delete(self, rid: str, owner: str = "") -> bool:
        with self._lock:
            kept = self.items.get(rid)
            return kept is not None and kept[0] == owner and self._pop(rid)


class DirectoryResponses(ResponseStore):
    """One JSON file per response, written whole (temporary file, then rename: a reader never sees half of one).
    Beyond ``capacity`` files or ``max_bytes`` the oldest are removed, checked every tenth of either (counted by
    whichever frontend puts). A file that cannot be written (a full disk) is logged and the response is simply not
    stored; an unreadable one reads as absent."""

    def __init__(self, root: str | Path, capacity: int, max_bytes: int = MAX_BYTES):
        self.root, self.capacity, self.max_bytes = Path(root), capacity, max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # one it finds keeps its mode: the operator's
        self._puts = self._bytes = 0  # since the last prune

    def _path(self, rid: str) -> Optional[Path]:
        return self.root / f"{rid}.json" if RESPONSE_ID.fullmatch(rid) else None

    def put(self, response: dict, conversation: list[dict], inputs: list[dict] = (), owner: str = "") -> None:
        path = self._path(response["id"])
        data = _record(response, conversation, inputs, owner)
        if self.capacity <= 0 or path is None or len(data) > self.max_bytes:
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            _write_private(tmp, data)
            os.replace(tmp, path)
        except OSError as e:
            log.error("response %s not stored in %s: %s", response["id"], self.root, e)
            tmp.unlink(missing_ok=True)
            return
        self._puts, self._bytes = self._puts + 1, self._bytes + len(data)
        if self._puts >= max(1, self.capacity // 10) or self._bytes >= self.max_bytes // 10:
            self._puts = self._bytes = 0
            self._prune()

    def _prune(self) -> None:
        files = []
        try:
            for entry in os.scandir(self.root):
                if entry.name.endswith(".json"):
                    with contextlib.suppress(FileNotFoundError):  # another frontend's prune took it
                        st = entry.stat()
                        files.append((st.st_mtime, st.st_size, entry.path))
        except OSError as e:
            log.warning("stored responses in %s not pruned: %s", self.root, e)
            return
        files.sort()
        count, total = len(files), sum(size for _, size, _ in files)
        for _, size, path in files:  # oldest first
            if count <= self.capacity and total <= self.max_bytes:
                break
            Path(path).unlink(missing_ok=True)
            count, total = count - 1, total - size

    def _read(self, rid: str) -> Optional[dict]:
        path = self._path(rid)
        if path is None:
            return None
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("stored response %s unreadable: %s", rid, e)
            return None

    def get(self, rid: str, owner: str = "") -> Optional[Entry]:
        data = self._read(rid)
        try:
            if data is None or data.get("owner", "") != owner:
                return None
            return data["response"], data["conversation"], data.get("input", [])
        except (KeyError, TypeError, AttributeError) as e:
            log.warning("stored response %s unreadable: %s", rid, e)
            return None

    def delete(self, rid: str, owner: str = "") -> bool:
        if self.get(rid, owner) is None:
            return False
        self._path(rid).unlink(missing_ok=True)
        return True


def _write_private(path: Path, data: bytes) -> None:
    """``data`` in ``path``, a file only this user may read (0600 whatever the umask, even if one was left there)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    finally:
        os.close(fd)
