"""The trajectory format: JSON Lines, one agent per line.

    {"id": "agent-7", "rounds": [
        {"append": [101, 2023, 318], "generate": 176, "tool_s": 2.5},
        {"append": "tool output as text", "max_tokens": 256}
    ]}

Each round appends its input to the agent's context (token ids, or text tokenized without special tokens) and
then generates: ``generate: N`` forces exactly N tokens (end-of-sequence ignored, as replays of recorded traces
need); ``max_tokens: N`` stops normally (end of sequence) or at N. Round i's prompt is everything before it (all
earlier appends and generated tokens) plus its own append. ``tool_s`` (optional: seconds, a non-negative finite
number, or null) is the tool call that follows the round, the gap before the next round is sent (absent: none).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dualpath.core.errors import DualPathError

log = logging.getLogger(__name__)


class TrajectoryError(DualPathError):
    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class Round:
    append: tuple[int, ...] | str
    generate: int | None = None  # forced length
    max_tokens: int | None = None  # normal stopping
    tool_s: float | None = None  # the tool call after this round: seconds until the next round (None: no gap)

    @property
    def forced(self) -> bool:
        return self.generate is not None


@dataclass(frozen=True)
class Trajectory:
    id: str
    rounds: tuple[Round, ...]


def _round(line: int, i: int, r) -> Round:
    where = f"round {i}"
    if not isinstance(r, dict):
        raise TrajectoryError(line, f"{where} is not an object")
    unknown = set(r) - {"append", "generate", "max_tokens", "tool_s"}
    if unknown:
        raise TrajectoryError(line, f"{where} has unknown fields {sorted(unknown)}")
    append = r.get("append")
    if isinstance(append, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in append):
            raise TrajectoryError(line, f"{where}: append must be non-negative token ids or text")
        append = tuple(append)
    elif not isinstance(append, str):
        raise TrajectoryError(line, f"{where}: append must be a list of token ids or a string")
    gen, mx = r.get("generate"), r.get("max_tokens")
    if (gen is None) == (mx is None):
        raise TrajectoryError(line, f"{where}: give exactly one of generate (forced) or max_tokens")
    n = gen if gen is not None else mx
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TrajectoryError(
            line, f"{where}: {'generate' if gen is not None else 'max_tokens'} must be a positive integer"
        )
    tool = r.get("tool_s")
    if tool is not None and (
        isinstance(tool, bool) or not isinstance(tool, (int, float)) or not math.isfinite(tool) or tool < 0
    ):
        raise TrajectoryError(line, f"{where}: tool_s must be a non-negative finite number of seconds")
    return Round(append, gen, mx, None if tool is None else float(tool))


def parse_line(line_no: int, text: str) -> Trajectory:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TrajectoryError(line_no, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TrajectoryError(line_no, "not a JSON object")
    tid, rounds = obj.get("id"), obj.get("rounds")
    if not isinstance(tid, (str, int)) or isinstance(tid, bool) or str(tid) == "":
        raise TrajectoryError(line_no, "id must be a non-empty string")
    if not isinstance(rounds, list) or not rounds:
        raise TrajectoryError(line_no, "rounds must be a non-empty list")
    return Trajectory(str(tid), tuple(_round(line_no, i, r) for i, r in enumerate(rounds)))


def read_trajectories(path: str | Path, skip_invalid: bool = False) -> Iterator[Trajectory]:
    """Trajectories of a JSONL file. A malformed line raises ``TrajectoryError`` naming its line, or with
    ``skip_invalid`` is logged and skipped; blank lines are ignored; duplicate ids are malformed."""
    seen: set[str] = set()
    with open(path) as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                t = parse_line(n, text)
                if t.id in seen:
                    raise TrajectoryError(n, f"duplicate id {t.id!r}")
                seen.add(t.id)
            except TrajectoryError as e:
                if not skip_invalid:
                    raise
                log.warning("skipping %s", e)
                continue
            yield t


def write_trajectories(path: str | Path, trajectories) -> None:
    with open(path, "w") as f:
        for t in trajectories:
            rounds = []
            for r in t.rounds:
                d = {"append": list(r.append) if isinstance(r.append, tuple) else r.append}
                d.update({"generate": r.generate} if r.forced else {"max_tokens": r.max_tokens})
                if r.tool_s is not None:
                    d["tool_s"] = r.tool_s
                rounds.append(d)
            f.write(json.dumps({"id": t.id, "rounds": rounds}) + "\n")
