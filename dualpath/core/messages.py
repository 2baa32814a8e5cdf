"""Messages between the frontend, the scheduler and the engines: frozen dataclasses on the wire.

The same types are the plain data the scheduler's policy works on, so a decision can be tested by building these
objects by hand. ``to_wire`` / ``from_wire`` encode any of them (nested dataclasses, lists, enums) as a JSON header
followed by raw binary segments: bulk data — token ids, block hashes — are ``bytes`` fields (little-endian uint32
tokens, concatenated 16-byte hashes) that travel as raw segments, so a 30K-token prompt costs a memory copy, not
30K JSON numbers or a base64 pass.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from dualpath.core.geometry import HASH_BYTES
from dualpath.core.sessions import SessionHint


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class ReadPath(str, enum.Enum):
    PE = "pe"  # storage -> prefill engine's buffer
    DE = "de"  # storage -> decode engine's buffer -> prefill engine


class Mode(str, enum.Enum):
    """How read paths are chosen for a run (``basic`` is the paper's baseline: PE path, no layerwise prefill)."""

    DUALPATH = "dualpath"
    PE = "pe"
    DE = "de"
    BASIC = "basic"
    SPLIT = "split"  # beyond the paper: one request's hit blocks read on both sides


@dataclass(frozen=True)
class EngineInfo:
    """What an engine tells the scheduler when it joins; the scheduler hands it to peers that must reach it."""

    engine_id: str
    role: Role
    node_id: str
    control_address: str  # host:port of the engine's gRPC control surface
    transport: str
    transport_address: dict
    regions: list[dict]  # RegionDesc.to_dict() of every registered region
    buffer_region: int
    buffer_slots: int
    block_size: int
    num_layers: int
    fingerprint: str  # hex
    capacity_tokens: int  # KV tokens the engine can hold (decode: paged cache; prefill: workspace)
    model: str = ""
    max_model_len: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    group_id: str = ""  # engines of one node and role; "" = a group of its own
    alpha_tokens: int = 0  # tokens this engine's node reads from storage in 3 s (0: unknown)
    beta_tokens: int = 0  # prefill engines: tokens the device prefills in 5 s (0: unknown)
    # the weights an update loaded since the engine started ("": those of ``model``): a restarted scheduler's
    # /get_weight_version and /get_model_info still tell the truth
    weights_version: str = ""
    weights_path: str = ""
    adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded at runtime (a new scheduler learns them)


@dataclass(frozen=True)
class EngineLoad:
    """A load report: the paper's seq, tok and read_q, plus free device memory and what changed."""

    engine_id: str
    seq: int  # unfinished requests on the engine
    tok: int  # their tokens
    read_q_tokens: int  # the node's storage read queue, in tokens
    free_tokens: int  # KV tokens that fit in free device memory
    request_ids: list[str] = field(default_factory=list)  # requests the engine holds (admitted, not finished)
    started: list[str] = field(default_factory=list)  # decode began (tokens may have streamed) since last report
    finished: list[str] = field(default_factory=list)
    failed: list[list[str]] = field(default_factory=list)  # [request_id, reason]
    stored_keys: bytes = b""  # block hashes written since the last report (packed)
    evicted_keys: bytes = b""
    prefill_busy_s: float = 0.0  # seconds spent in prefill attention since the last report (PEs)
    prefill_tokens: int = 0  # the new tokens computed in those seconds
    storage_read_bytes: int = 0  # completed storage read bytes since the last report
    # [start, end, tokens read] of the last 10 s while blocks waited for this engine's reads (its monotonic clock,
    # shared by the node's engines; ReadAccounting.drain_intervals); none when its alpha is pinned by a flag
    read_intervals: list[list[float]] = field(default_factory=list)
    kv_load_failures: int = 0  # stored blocks found missing or corrupt since the last report (recomputed)
    kv_corrupt_removed: int = 0  # corrupt block files removed since the last report (to be stored again)
    rpc_refused: int = 0  # calls to this engine refused for want of the cluster's credentials, since the last report
    traffic: dict = field(default_factory=dict)  # cumulative bytes moved, "path:class" -> bytes
    # data-parallel attention: the group's forward time outside MoE exchanges, max/avg over its engines (recent
    # units in which all of them computed; 0: not in a group, or no such unit yet)
    dp_balance: float = 0.0
    speculative: dict = field(default_factory=dict)  # decode engines: cumulative "drafted", "accepted" tokens
    storage_used_bytes: int = 0  # the KV store this engine writes to and reads from: stored bytes, its cap (0: none)
    storage_capacity_bytes: int = 0
    prefetch: dict = field(default_factory=dict)  # cumulative block counts of the engine's Prefetcher (its stats)
    leaving: bool = False  # the engine's last report: it is stopping (count it gone now, move what it held)


@dataclass(frozen=True)
class SubmitRequest:
    request_id: str
    tokens: bytes  # pack_tokens(prompt)
    sampling: dict  # SamplingParams.to_dict()
    mode: str = ""  # a read-path mode for this request only ("" = the scheduler's)
    block_hashes: bytes = b""  # the prompt's chained block hashes, if the submitter computed them (packed)
    fingerprint: str = ""  # hex: the model fingerprint those hashes chain from (the weights may have changed since)
    label: str = ""  # the submitter's name for it (an HTTP request's id, SGLang's rid): what ``Abort`` matches
    session: SessionHint | None = None  # the agent session it is a turn of (``dualpath.core.sessions``)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4


@dataclass(frozen=True)
class TurnEnd:
    """Submitter -> scheduler, after a session's turn replied: what the next turn's prompt will repeat after this
    turn's (``output_tokens``, packed: choice 0's reply as the context will hold it) and whether the session now
    waits for a tool (the reply ended in tool calls: the next turn comes when the tool is done)."""

    request_id: str
    output_tokens: bytes = b""
    tool_wait: bool = True
    next_turn_in_s: float = -1.0  # the submitter's estimate of the gap (-1: none; the request's hint, or learned)


@dataclass(frozen=True)
class PrefetchOrder:
    """Scheduler -> engine: read these stored blocks into your buffer now, at low priority, for a session's next
    turn; free them if no request used them within ``hold_s``."""

    session: str  # the session's key (logs and metrics)
    keys: bytes  # packed hashes, leading block first
    hold_s: float


@dataclass(frozen=True)
class SubmitEvent:
    """What the scheduler tells a submitter: ``accepted`` (with the hit length), ``assigned`` (where to stream
    tokens from; may come again if the request is retried elsewhere), ``failed``."""

    kind: str
    request_id: str
    num_hit_tokens: int = 0
    decode_engine: str = ""
    decode_address: str = ""
    path: str = ""
    error: str = ""
    work_id: str = ""  # the id engines know this attempt by (stream tokens with it)
    fingerprint: str = ""  # on "accepted", when the submitter hashed with a stale fingerprint: the current one
    engine_lost: bool = False  # on "failed": its decode engine died while generating (the reply may continue)
    aborted: bool = False  # on "failed": ended by an abort (a weight update's): the reply so far stands, unfinished
    preempted: bool = False  # on "failed" with engine_lost: handed back for a more urgent request (it goes on)
    param: str = ""  # on "failed" for an invalid request: the request field at fault (HTTP errors' ``param``)
    prefetched: bool = False  # on "assigned": a session's turn placed where a prefetch of its KV was read ahead


@dataclass(frozen=True)
class Assignment:
    """A request handed to a prefill engine, with everything it needs to run it."""

    request_id: str
    tokens: bytes  # packed prompt
    sampling: dict
    hit_keys: bytes  # packed hashes of the leading stored blocks
    path: ReadPath
    layerwise: bool
    decode: EngineInfo
    split_pe_blocks: int = -1  # split path: how many leading hit blocks the PE reads (-1: not split)

    @property
    def num_hit_blocks(self) -> int:
        return len(self.hit_keys) // HASH_BYTES


@dataclass(frozen=True)
class PullRequest:
    group_id: str
    loads: list[EngineLoad]
    sender: str = ""  # the engine that pulls (the group's leader)
    unreachable: list[str] = field(default_factory=list)  # group members that stopped answering the sender


@dataclass(frozen=True)
class PullReply:
    assignments: dict[str, list[Assignment]]  # engine id -> new work
    cancelled: list[str] = field(default_factory=list)
    members: list[list[str]] = field(default_factory=list)  # the group: [engine id, control address], alive
    # engines whose loads came in but which the scheduler declared gone (after a silence): their work was re-queued
    # or failed; they drop it and register again
    rejoin: list[str] = field(default_factory=list)
    # engines this scheduler never registered (it restarted): they register, keeping their work (its submitters
    # stream it from the decode engines; the scheduler holds no part of it)
    unknown: list[str] = field(default_factory=list)
    # decode engines: work ids to hand back to their submitters to go on later (priority scheduling made room for
    # a more urgent request: ``SchedulerCore._preempt_for``); what they generated is stored first
    preempted: list[str] = field(default_factory=list)
    prefetch: dict[str, list[PrefetchOrder]] = field(default_factory=dict)  # engine id -> sessions' KV to read ahead


@dataclass(frozen=True)
class RegisterReply:
    ok: bool
    error: str = ""
    members: list[list[str]] = field(default_factory=list)  # the engine's group as the scheduler knows it
    adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded at runtime: a joining engine loads them


@dataclass(frozen=True)
class PrepareRequest:
    """Prefill engine -> decode engine: hold buffer slots for this prompt; for the DE path, load the hit blocks."""

    request_id: str
    num_prompt_tokens: int
    first_load_block: int  # the first block index of load_keys in the prompt
    load_keys: bytes  # packed: the hit blocks the decode engine reads from storage (DE and split paths)
    max_tokens: int  # the most tokens each choice still generates (``SamplingParams.max_new_tokens``)
    n: int = 1  # choices: each decodes up to max_tokens, sharing the prompt's blocks


@dataclass(frozen=True)
class PrepareReply:
    ok: bool
    slots: list[int] = field(default_factory=list)
    num_loaded_blocks: int = 0  # leading load_keys that loaded intact (fewer: recompute from there)
    error: str = ""


@dataclass(frozen=True)
class PrefillDone:
    """Prefill engine -> decode engine: the prompt's KV is in your buffer; here is each choice's first token."""

    request_id: str
    tokens: bytes  # packed prompt
    sampling: dict
    first_tokens: list[int]  # choice i's first token (``n`` of them)
    first_logprobs: list[dict | None] = field(default_factory=list)  # choice i's, when asked
    generator_states: list[str] = field(default_factory=list)  # hex of choice i's torch.Generator state (sampled)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from storage
    path: str = ""
    storage_bytes: int = 0
    prompt_logprobs: list[dict] | None = None  # TokenLogprob fields of prompt tokens 1.., when asked


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int = -1
    logprob: dict | None = None
    finish_reason: str = ""
    num_prompt_tokens: int = 0  # these four: on finish events, and on each choice's first token's
    num_cached_tokens: int = 0
    path: str = ""
    storage_bytes: int = 0
    error: str = ""
    prompt_logprobs: list[dict] | None = None  # TokenLogprob fields of prompt tokens 1.., on a choice's first event
    index: int = 0  # the choice (``SamplingParams.n``) the token or finish belongs to
    final: bool = True  # with finish_reason: the request's last event (False: only this choice finished)
    ending: str = ""  # on a token that ended its choice: the finish reason its finish event will bring
    engine_lost: bool = False  # with finish_reason "abort": the engine is stopping; the reply goes on elsewhere
    preempted: bool = False  # with engine_lost: ended for a more urgent request; it goes on (not a migration)


@dataclass(frozen=True)
class Ack:
    ok: bool = True
    error: str = ""


@dataclass(frozen=True)
class RequestRef:
    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class WeightUpdate:
    """Load new weights for the served model from a checkpoint directory (the same config, other values).

    To the scheduler: pause admission, let the requests in flight finish (or, with ``abort``, send back those
    not yet generating and end those generating), have every engine load the weights, then resume with the new
    fingerprint. To an engine: load them now (refused while it holds work)."""

    model_path: str
    version: str = ""  # a label the caller gives the weights (reported back; "" = none)
    timeout_s: float = 600.0  # for the requests in flight to finish, then for the engines to load
    abort: bool = False
    check_only: bool = False  # to an engine: only check the checkpoint fits (the scheduler asks all before any loads)


@dataclass(frozen=True)
class AdapterLoad:
    """Load the PEFT LoRA adapter at ``path`` (vLLM's ``/v1/load_lora_adapter``). To the scheduler: on every engine,
    and on every engine that joins later. To an engine: now (requests it runs meanwhile are unaffected)."""

    path: str
    timeout_s: float = 120.0


@dataclass(frozen=True)
class AdapterLoadReply:
    ok: bool
    error: str = ""
    digest: str = ""  # the adapter's identity (dualpath.core.lora.adapter_digest) as the engines loaded it
    engines: int = 0  # engines that loaded it


@dataclass(frozen=True)
class WeightUpdateReply:
    ok: bool
    error: str = ""
    fingerprint: str = ""  # hex, of the weights now served
    version: str = ""
    engines: int = 0  # engines that loaded them
    aborted: int = 0  # requests ended (those generating) by ``abort``
    seconds: float = 0.0
    busy: bool = False  # an engine's refusal because it still holds work (the scheduler asks again)


@dataclass(frozen=True)
class Abort:
    """To the scheduler: end the requests in flight labelled ``label`` (every one with ``every``) where they are:
    their choices finish with the tokens they had, reason abort (SGLang's /abort_request, cluster-wide)."""

    label: str = ""
    every: bool = False


@dataclass(frozen=True)
class AbortReply:
    aborted: int = 0  # requests ended


@dataclass(frozen=True)
class Hold:
    """To the scheduler: hand no request sent from now on to an engine (``on``; with ``abort`` every request in
    flight ends now, else wait up to ``wait_s`` for those sent before to end), or go on again (not ``on``)."""

    on: bool
    abort: bool = False
    wait_s: float = 0.0


@dataclass(frozen=True)
class HoldReply:
    aborted: int = 0  # requests ended by ``abort``
    drained: bool = True  # every request sent before the hold ended (false: some still ran when ``wait_s`` ran out)


@dataclass(frozen=True)
class Stats:
    data: dict


@dataclass(frozen=True)
class SessionIn:
    """A submitter's batch on its session stream: new requests, cancellations, and engines whose token streams
    broke on it (the scheduler checks them at once rather than wait out their heartbeats)."""

    submits: list[SubmitRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    turn_ends: list[TurnEnd] = field(default_factory=list)  # sessions' turns that replied (agent sessions)


@dataclass(frozen=True)
class SessionOut:
    """The scheduler's batch on a session stream: every event since the last batch, for any of its requests."""

    events: list[SubmitEvent] = field(default_factory=list)


# --- bulk payloads --------------------------------------------------------------------------------------------
def pack_tokens(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<u4").tolist()


def pack_keys(keys: Sequence[bytes]) -> bytes:
    return b"".join(keys)


def unpack_keys(data: bytes) -> list[bytes]:
    return [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


# --- wire codec: [u32 header length][JSON header][u64 length][bytes]... ------------------------------------------
_PLAIN = frozenset((str, int, float, bool, type(None)))


_REQUIRED = object()


@lru_cache(maxsize=None)
def _fields(cls) -> tuple[tuple[str, Any], ...] | None:
    """A dataclass's fields as (name, default), ``_REQUIRED`` for a field without one (a factory's default is its
    value: every factory here makes an empty container); None for any other type."""
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(
        (
            f.name,
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else _REQUIRED,
        )
        for f in dataclasses.fields(cls)
    )


def changed_fields(obj: Any) -> list[tuple[str, Any]]:
    """(name, value) of each field of the dataclass ``obj`` that a wire form must name: every required one, and
    those that differ from their defaults (readers fill the rest in). A load report of 26 fields, most of them zero
    or empty, travels as the few that say something."""
    out = []
    for name, default in _fields(type(obj)):
        v = getattr(obj, name)
        if default is _REQUIRED or type(v) is not type(default) or v != default:
            out.append((name, v))
    return out


def _sparse(obj: Any, blobs: list[bytes]) -> dict:
    return {name: _plain(v, blobs) for name, v in changed_fields(obj)}


def _plain(obj: Any, blobs: list[bytes]) -> Any:
    if type(obj) in _PLAIN:  # most values: checked before anything costlier
        return obj
    if _fields(type(obj)) is not None:
        if type(obj) is EngineInfo:  # sent with every assignment: convert once per engine, not per message
            cached = obj.__dict__.get("_wire")
            if cached is None:  # (EngineInfo has no bytes fields, so the cached form holds no blob references)
                cached = _sparse(obj, blobs)
                object.__setattr__(obj, "_wire", cached)
            return cached
        return _sparse(obj, blobs)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (bytes, bytearray, memoryview)):
        blobs.append(obj)
        return {"$b": len(blobs) - 1}
    if isinstance(obj, (list, tuple)):
        return [_plain(x, blobs) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v, blobs) for k, v in obj.items()}
    return obj


def to_wire(obj: Any) -> bytes:
    blobs: list = []
    header = json.dumps(_plain(obj, blobs), separators=(",", ":")).encode()
    parts = [struct.pack("<I", len(header)), header]
    for b in blobs:
        parts += [struct.pack("<Q", len(b)), b]
    return b"".join(parts)


_SCALARS = (str, int, float, bool, Any)


def _keep(value: Any, blobs: list[bytes]) -> Any:
    return value


@lru_cache(maxsize=None)
def _decoder(tp: Any) -> Callable[[Any, list[bytes]], Any]:
    """How to turn the plain form of a ``tp`` back into one, worked out once per type (messages are decoded
    thousands of times a second by the scheduler)."""
    if tp in _SCALARS:
        return _keep
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decoder(args[0]) if len(args) == 1 else _keep
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        item = _decoder(arg)
        return _keep if item is _keep else _none_passes(lambda v, b: [item(x, b) for x in v])
    if origin is dict:
        _, arg = typing.get_args(tp) or (Any, Any)
        item = _decoder(arg)
        return _keep if item is _keep else _none_passes(lambda v, b: {k: item(x, b) for k, x in v.items()})
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        convs = {f.name: _decoder(hints[f.name]) for f in dataclasses.fields(tp)}
        # a header names only the fields that differ from their defaults, and may name some this reader lacks
        return _none_passes(lambda d, b: tp(**{n: convs[n](v, b) for n, v in d.items() if n in convs}))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _none_passes(lambda v, b: tp(v))
    if tp is bytes:
        return _none_passes(lambda v, b: b[v["$b"]])
    return _keep


def _none_passes(conv: Callable[[Any, list[bytes]], Any]) -> Callable[[Any, list[bytes]], Any]:
    return lambda v, b: None if v is None else conv(v, b)


def from_dict(cls, d: dict):
    """A message from its plain form (no binary segments)."""
    return _decoder(cls)(d, [])


def from_wire(cls, data: bytes):
    (hlen,) = struct.unpack_from("<I", data, 0)
    header = json.loads(data[4 : 4 + hlen])
    blobs, pos = [], 4 + hlen
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        blobs.append(bytes(data[pos + 8 : pos + 8 + n]))
        pos += 8 + n
    return _decoder(cls)(header, blobs)
