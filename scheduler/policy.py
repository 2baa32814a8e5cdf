"""Scheduling policy as pure code: plain data in, decisions out. No sockets, no torch, no processes.

A request is placed in three steps, each a method of ``Policy``:
1. ``route_decode_group`` (phase 1 of the paper's decode choice): from the global queue into one decode group's
   private queue;
2. ``assign_decode`` (phase 2), when that group pulls: a decode engine whose free device memory holds the
   request's prompt and generation budget;
3. ``assign_prefill``, when a prefill group pulls: a prefill engine and the read path (and, with
   ``recompute_slow_hits``, how much of the stored prefix to load: ``blocks_to_load``).
Policies see every engine of the role as an ``EngineState`` copy they may update as they assign, and the ids of
the pulling group's engines; they return decisions naming only pulling engines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Sequence

from dualpath.core.messages import Mode, ReadPath


@dataclass
class EngineState:
    """One engine's load as a policy sees it (a copy: policies update it as they assign)."""

    engine_id: str
    node_id: str
    group_id: str
    seq: int = 0  # unfinished requests
    tok: int = 0  # their tokens: decode: prompt + generated; prefill: tokens still to compute
    free_tokens: int = 0  # KV tokens that fit in free device memory (decode engines)
    beta: int = 0  # prefill engines: tokens the device prefills in 5 s (0: unknown)
    measured_beta: int = 0  # the same, as measured on the requests it ran lately (0: not yet)


@dataclass
class NodeState:
    read_q: int = 0  # the node's storage read queue, in tokens
    alpha: int = 0  # tokens the node reads in 3 s (0: unknown)
    recent_read: float = 0.0  # bytes the node read from storage lately (the balance window)


@dataclass(frozen=True)
class Affinity:
    """A session's turn as placement may prefer it (``dualpath.scheduler.sessions``): the engines of its last turn
    (``de_group``: that decode engine's group), and the engine holding a prefetch of its ``prefetch_blocks``
    leading blocks. A preference only: the balance rules decide whether it holds."""

    pe: str = ""
    de: str = ""
    de_group: str = ""
    prefetch_engine: str = ""
    prefetch_blocks: int = 0


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    num_tokens: int  # prompt tokens
    num_hit_tokens: int  # leading prompt tokens stored
    reserve_tokens: int  # device memory a decode engine needs: prompt + generation budget
    decode_node: str = ""  # set once a decode engine holds it
    mode: Mode = Mode.DUALPATH  # how its read path is chosen
    decode_engine: str = ""  # set once a decode engine holds it
    affinity: Affinity | None = None  # a session's turn: where it would rather go

    @property
    def num_miss_tokens(self) -> int:
        return self.num_tokens - self.num_hit_tokens


@dataclass(frozen=True)
class PathChoice:
    path: ReadPath
    pe_blocks: int = -1  # split: leading hit blocks read on the PE side; -1 = the whole read on ``path``
    load_blocks: int = -1  # leading hit blocks loaded, the rest recomputed; -1 = every hit block

    def loaded_tokens(self, r: "QueuedRequest", block_size: int) -> int:
        return r.num_hit_tokens if self.load_blocks < 0 else min(r.num_hit_tokens, self.load_blocks * block_size)


@dataclass(frozen=True)
class PrefillDecision:
    request_id: str
    engine_id: str
    path: PathChoice


def take_decode(e: EngineState, r: QueuedRequest) -> None:
    e.seq += 1
    e.tok += r.num_tokens
    e.free_tokens -= r.reserve_tokens


def take_prefill(e: EngineState, r: QueuedRequest, recomputed: int = 0) -> None:
    e.seq += 1
    e.tok += r.num_miss_tokens + recomputed


def shorter_queue(r: QueuedRequest, pe_node: NodeState, de_node: NodeState) -> PathChoice:
    """The paper's rule: read on the side whose node has the shorter storage read queue. Equal queues (both
    empty, under light load) go to the node that read less lately, so read volume balances even when no queue
    builds."""
    pe_key, de_key = (pe_node.read_q, pe_node.recent_read), (de_node.read_q, de_node.recent_read)
    return PathChoice(ReadPath.PE if pe_key <= de_key else ReadPath.DE)


def split_path(r: QueuedRequest, pe_read_q: int, de_read_q: int, block_size: int) -> PathChoice:
    """Beyond the paper: divide the hit blocks so both sides' queues, with their share added, drain together.

    With equal read bandwidth per node, the PE side takes ``(hit + de_q - pe_q) / 2`` tokens, clamped to the hit.
    """
    hit_blocks = r.num_hit_tokens // block_size
    if hit_blocks == 0:
        return PathChoice(ReadPath.PE)
    pe_tokens = (r.num_hit_tokens + de_read_q - pe_read_q) / 2
    pe_blocks = max(0, min(hit_blocks, round(pe_tokens / block_size)))
    if pe_blocks == hit_blocks:
        return PathChoice(ReadPath.PE)
    if pe_blocks == 0:
        return PathChoice(ReadPath.DE)
    return PathChoice(ReadPath.DE, pe_blocks)


def add_read(choice: PathChoice, r: QueuedRequest, pe_node: NodeState, de_node: NodeState, block_size: int) -> None:
    """Charge the hit tokens the request loads to the node(s) that will read them."""
    loaded = choice.loaded_tokens(r, block_size)
    pe_share = loaded if choice.path is ReadPath.PE else min(loaded, max(0, choice.pe_blocks) * block_size)
    pe_node.read_q += pe_share
    de_node.read_q += loaded - pe_share
    pe_node.recent_read += pe_share
    de_node.recent_read += loaded - pe_share


@dataclass(frozen=True)
class Running:
    """A reply a decode engine generates, as preemption sees it."""

    work_id: str
    rank: int  # its priority: lower is more urgent
    seq: int  # its place in the order of submissions
    reserve_tokens: int  # the device memory it holds (prompt and generation budget): freed when it ends


def preemption(need: int, rank: int, free: dict[str, int], running: dict[str, list[Running]]) -> tuple[str, list[str]]:
    """Priority scheduling's preemption (vLLM's order): the engine, of ``free`` (engine -> its free tokens), where
    ending the fewest replies less urgent than ``rank`` makes room for ``need`` tokens, and those replies' work ids,
    the least urgent first and the latest submitted first among equals. ``("", [])`` when no engine can make room
    that way (or one already has it: nothing needs ending)."""
    best: tuple[str, list[str]] = ("", [])
    for eid, room in free.items():
        if room >= need:
            return "", []
        victims = []
        for v in sorted((v for v in running.get(eid, ()) if v.rank > rank), key=lambda v: (-v.rank, -v.seq)):
            victims.append(v.work_id)
            room += v.reserve_tokens
            if room >= need:
                break
        if room >= need and (not best[1] or len(victims) < len(best[1])):
            best = (eid, victims)
    return best


AFFINITY_SLACK = 1.05  # a session's turn keeps its decode group while that group holds at most this x the mean
RECOMPUTE_GAIN = 0.75  # recompute a hit only if that ends the prefill in at most this share of the time


def blocks_to_load(
    hit_blocks: int, block_size: int, miss_tokens: int, read_q: int, alpha: int, pe_tok: int, beta: int
) -> int:
    """How many of a request's leading hit blocks to load (``hit_blocks``), or none (0: the whole prompt is
    recomputed) when loading is slow: a deep read queue, a slow store. Loading ``h`` tokens behind a read queue of
    ``read_q`` takes ``(read_q + h) / (alpha / 3)`` s (alpha: tokens the node reads in 3 s); computing ``c`` tokens
    behind the engine's ``pe_tok`` takes ``(pe_tok + c) / (beta / 5)`` s (beta: tokens it was measured to prefill
    in 5 s). The two add up: a prefill is cut into chunks of a compute quota, and the first chunk needs every
    layer of the loaded prefix, so a long load is not hidden behind the rest (measured on SmolLM2: loading 1,000
    tokens and computing 350 took their sum). So it is all or nothing, and nothing only when that ends the prefill in
    ``RECOMPUTE_GAIN`` of the time (the rates are estimates); every block when alpha or beta is unknown (0)."""
    if hit_blocks <= 0 or alpha <= 0 or beta <= 0:
        return hit_blocks
    read_rate, compute_rate = alpha / 3, beta / 5
    hit = hit_blocks * block_size
    load_all = (read_q + hit) / read_rate + (pe_tok + miss_tokens) / compute_rate
    compute_all = (pe_tok + miss_tokens + hit) / compute_rate
    return 0 if compute_all <= RECOMPUTE_GAIN * load_all else hit_blocks


def prefetched_side(r: QueuedRequest, pe_engine: str) -> ReadPath | None:
    """The side that holds a prefetch of ``r``'s KV if ``r`` runs on ``pe_engine``: its prefill engine (PE path) or
    the decode engine it holds (DE path); None when neither does, or its mode reads on the other side only."""
    a = r.affinity
    if a is None or not a.prefetch_blocks or not a.prefetch_engine:
        return None
    if a.prefetch_engine == pe_engine and r.mode is not Mode.DE:
        return ReadPath.PE
    if a.prefetch_engine == r.decode_engine and r.mode not in (Mode.PE, Mode.BASIC):
        return ReadPath.DE
    return None


def preferred(r: QueuedRequest, pool: Sequence[EngineState], sticky: bool, role: str) -> EngineState | None:
    """The engine of ``pool`` (already bounded by the balance rules) a session's turn prefers: the one holding its
    prefetch, else (``sticky``) the decode engine of its last turn; ``role``: "pe" or "de"."""
    a = r.affinity
    if a is None:
        return None
    want = a.prefetch_engine if a.prefetch_blocks else ""
    if not want and sticky and role == "de":
        want = a.de
    return next((e for e in pool if e.engine_id == want), None) if want else None


class Policy(ABC):
    """Decides placements. Called by the scheduler when requests arrive and when engine groups pull."""

    name = "policy"
    recompute_slow_hits = False  # the paper's systems load every hit; live schedulers turn this on (make_policy)
    affinity = True  # a session's turn prefers its last decode engine where the balance rules allow (the core sets)

    def route_decode_group(self, r: QueuedRequest, groups: dict[str, int]) -> str | None:
        """Phase 1: the decode group whose private queue takes ``r`` (``groups``: group -> its total tokens, queued
        included). Default: the least loaded; a session's turn keeps its last decode engine's group while that
        group holds no more than ``AFFINITY_SLACK`` times the groups' mean."""
        if not groups:
            return None
        a = r.affinity
        if a is not None and a.de_group in groups and (self.affinity or a.prefetch_blocks):
            if groups[a.de_group] <= AFFINITY_SLACK * sum(groups.values()) / len(groups):
                return a.de_group
        return min(zip(groups.values(), groups))[1]  # ties: the first name

    @abstractmethod
    def assign_decode(
        self, queue: Sequence[QueuedRequest], engines: list[EngineState], pulling: set[str]
    ) -> list[tuple[str, str]]:
        """Phase 2: (request, decode engine) pairs for a FIFO prefix of the group's private ``queue`` over the
        group's ``engines``; each must fit its engine's free memory and name a pulling engine."""

    @abstractmethod
    def assign_prefill(
        self,
        queue: Sequence[QueuedRequest],
        engines: list[EngineState],
        pulling: set[str],
        nodes: dict[str, NodeState],
        pe_nodes: dict[str, str],
        block_size: int,
    ) -> list[PrefillDecision]:
        """Prefill engines and read paths for a FIFO prefix of ``queue`` (requests that hold a decode engine),
        naming pulling engines. ``pe_nodes``: prefill engine -> its node; ``nodes`` may be updated."""

    def takes_no_prefill(self, group: list[EngineState]) -> bool:
        """Whether a pulling prefill ``group`` (per-group policies) could be given no request, whatever the queue
        holds: the scheduler then skips its pulls' placement until one of its engines changes. False unless a
        policy knows; it must never be True where ``assign_prefill`` could place something."""
        return False

    def choose_path(
        self, r: QueuedRequest, pe_node: NodeState, de_node: NodeState, mode: Mode, block_size: int
    ) -> PathChoice:
        if mode in (Mode.PE, Mode.BASIC):
            return PathChoice(ReadPath.PE)
        if mode is Mode.DE:
            return PathChoice(ReadPath.DE)
        if mode is Mode.SPLIT:
            return split_path(r, pe_node.read_q, de_node.read_q, block_size)
        return self.dualpath_path(r, pe_node, de_node)

    def dualpath_path(self, r: QueuedRequest, pe_node: NodeState, de_node: NodeState) -> PathChoice:
        return shorter_queue(r, pe_node, de_node)

    def place_prefill(
        self, r: QueuedRequest, e: EngineState, nodes: dict[str, NodeState], pe_node: str, block_size: int
    ) -> PrefillDecision:
        """Commit ``r`` to prefill engine ``e``: pick the path, charge the engine and the reading node(s)."""
        pn, dn = nodes.setdefault(pe_node, NodeState()), nodes.setdefault(r.decode_node, NodeState())
        side = prefetched_side(r, e.engine_id)
        if side is not None:  # read where the prefetch is: from DRAM, only its tail (if any) from storage
            choice = PathChoice(side)
            take_prefill(e, r)
            held = min(r.num_hit_tokens, r.affinity.prefetch_blocks * block_size)
            add_read(choice, replace(r, num_hit_tokens=r.num_hit_tokens - held), pn, dn, block_size)
            return PrefillDecision(r.request_id, e.engine_id, choice)
        choice = self.choose_path(r, pn, dn, r.mode, block_size)
        if self.recompute_slow_hits and choice.pe_blocks < 0 and r.num_hit_tokens:
            reader = pn if choice.path is ReadPath.PE else dn
            hit_blocks = r.num_hit_tokens // block_size
            load = blocks_to_load(
                hit_blocks, block_size, r.num_miss_tokens, reader.read_q, reader.alpha, e.tok, e.measured_beta
            )  # a start-up profile's beta can be far off (3x on SmolLM2)
            if load < hit_blocks:
                choice = PathChoice(choice.path, load_blocks=load)
        take_prefill(e, r, r.num_hit_tokens - choice.loaded_tokens(r, block_size))
        add_read(choice, r, pn, dn, block_size)
        return PrefillDecision(r.request_id, e.engine_id, choice)
