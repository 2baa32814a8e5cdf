"""Where the Responses API's stored responses live (for ``GET /v1/responses/{id}`` and ``previous_response_id``).

``DirectoryResponses`` keeps each response in a file of a directory every frontend mounts (by default beside the KV
store), so any frontend replica continues any conversation and a restart loses none: conversation state lives in
storage, as the KV does, never only in one process. ``MemoryResponses`` keeps them in the frontend's memory (one
frontend, nothing across restarts).
"""
from __future__ import annotations

import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

Entry = tuple[dict, list[dict], list[dict]]  # the response object, the conversation's messages it ends, its input items
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # what the frontend makes: anything else was never stored


class ResponseStore(ABC):
    """The frontend calls ``put`` once a stored response is complete, ``get`` for reads and continuations,
    ``delete`` for DELETE. Each keeps at most ``capacity`` responses (the oldest go first), never raises for an id it
    does not hold, and may be called from several threads."""

    @abstractmethod
    def put(self, response: dict, conversation: list[dict], inputs: list[dict] = ()) -> None:
        """Keep ``response`` (its ``id``), the messages a later turn continues and the request's input items."""

    @abstractmethod
    def get(self, rid: str) -> Optional[Entry]:
        """The response, its conversation and its input items, or None."""

    @abstractmethod
    def delete(self, rid: str) -> bool:
        """Whether there was one to delete."""


class MemoryResponses(ResponseStore):
    """In this process, least recently used out first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[str, Entry] = OrderedDict()

    def put(self, response: dict, conversation: list[dict], inputs: list[dict] = ()) -> None:
        if self.capacity <= 0:
            return
        self.items[response["id"]] = (response, conversation, list(inputs))
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, rid: str) -> Optional[Entry]:
        entry = self.items.get(rid)
        if entry is not None:
            self.items.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        return self.items.pop(rid, None) is not None


class DirectoryResponses(ResponseStore):
    """One JSON file per response, written whole (temporary file, then rename: a reader never sees half of one).
    Beyond ``capacity`` files the oldest are removed, checked every tenth of ``capacity`` puts (by whichever frontend
    puts). A file that cannot be written (a full disk) is logged and the response is simply not stored; an unreadable
    one reads as absent."""

    def __init__(self, root: str | Path, capacity: int):
        self.root, self.capacity = Path(root), capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self._puts = 0

    def _path(self, rid: str) -> Optional[Path]:
        return self.root / f"{rid}.json" if RESPONSE_ID.fullmatch(rid) else None

    def put(self, response: dict, conversation: list[dict], inputs: list[dict] = ()) -> None:
        path = self._path(response["id"])
        if self.capacity <= 0 or path is None:
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"response": response, "conversation": conversation, "input": list(inputs)}))
            os.replace(tmp, path)
        except OSError as e:
            log.error("response %s not stored in %s: %s", response["id"], self.root, e)
            tmp.unlink(missing_ok=True)
            return
        self._puts += 1
        if self._puts % max(1, self.capacity // 10) == 0:
            self._prune()

    def _prune(self) -> None:
        try:
            files = sorted((e.stat().st_mtime, e.path) for e in os.scandir(self.root) if e.name.endswith(".json"))
        except OSError as e:
            log.warning("stored responses in %s not pruned: %s", self.root, e)
            return
        for _, path in files[:max(0, len(files) - self.capacity)]:
            Path(path).unlink(missing_ok=True)

    def get(self, rid: str) -> Optional[Entry]:
        path = self._path(rid)
        if path is None:
            return None
        try:
            data = json.loads(path.read_text())
            return data["response"], data["conversation"], data.get("input", [])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("stored response %s unreadable: %s", rid, e)
            return None

    def delete(self, rid: str) -> bool:
        path = self._path(rid)
        if path is None or not path.exists():
            return False
        path.unlink(missing_ok=True)
        return True
