"""The P/D planner's analytic part: the range of prefill/decode node ratios in which DualPath, with every storage
NIC saturated, adds no bottleneck on any compute NIC or DRAM (paper §4.2)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import partial

from dualpath.sim.hardware import EngineModel, Hardware, engines_per_node
from dualpath.sim.links import DECODE, PREFILL, link_load


@dataclass(frozen=True)
class RatioRange:
    low: float  # P/D must be at least this (prefill CNIC write)
    high: float  # ... and at most this (decode CNIC read/write, decode DRAM)
    binding_high: str  # which constraint sets ``high``
    pe_read_ok: bool  # the prefill CNIC read constraint (s <= g/2), independent of P/D

    @property
    def feasible(self) -> bool:
        return self.pe_read_ok and self.low <= self.high

    def contains(self, ratio: float, tol: float = 1e-9) -> bool:
        return self.feasible and self.low - tol <= ratio <= self.high + tol


def bottleneck_free_range(hw: Hardware) -> RatioRange:
    """s/(g-s) <= P/D <= min{(g-2s)/s, (g-s)/(2s), (M/(Bs)-3)/2}, with s = storage_ratio, B the CNIC bandwidth."""
    g, s = hw.gpus, hw.storage_ratio
    low = s / (g - s) if g > s else float("inf")
    highs = {
        "decode CNIC read": (g - 2 * s) / s,
        "decode CNIC write": (g - s) / (2 * s),
        "decode DRAM": (hw.dram_bps / hw.snic_bps - 3) / 2,
    }
    binding = min(highs, key=highs.get)
    return RatioRange(low, highs[binding], binding, 2 * s <= g)


def engine_layout(hw: Hardware, engine: EngineModel, prefill_tp: int, decode_tp: int) -> dict[str, dict]:
    """Per role, the engines a node runs at that TP and one engine's size: ``tp`` GPUs, ``compute_gpus`` (one
    GPU's compute times ``EngineModel.tp_speedup``) and, for decode, the KV tokens it holds. Refuses (ConfigError)
    a TP that does not divide the node's GPUs. The §4.2 range is per node, so TP does not move it."""
    out = {}
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        out[role] = {
            "tp": tp,
            "engines_per_node": engines_per_node(hw, tp, role),
            "compute_gpus": engine.tp_speedup(tp),
        }
    out["decode"]["kv_tokens"] = engine.with_tp(decode_tp).decode_kv_tokens
    return out


def node_counts(ratio_range: RatioRange, total_nodes: int) -> list[tuple[int, int]]:
    """Every (P, D) split of ``total_nodes`` inside the range."""
    return [(p, total_nodes - p) for p in range(1, total_nodes) if ratio_range.contains(p / (total_nodes - p))]


def storage_bound_turns_per_s(hw: Hardware, nodes: int, kv_bytes_per_token: int, hit_tokens: int) -> float:
    """The most agent turns per second a cluster of ``nodes`` can serve when every turn loads ``hit_tokens`` of
    stored KV and all storage NICs are busy (DualPath reads through every node's SNIC; Basic only through the
    prefill nodes')."""
    return nodes * hw.snic_bps / (kv_bytes_per_token * hit_tokens)


def describe(hw: Hardware, prefill_nodes: int, decode_nodes: int) -> str:
    """A table of per-node link utilizations with storage saturated, for ``dualpath plan``."""
    load = link_load(hw, prefill_nodes, decode_nodes)
    rows = [f"{'side':8} {'link':11} {'GB/s':>9} {'util':>6}"]
    for side, links in load.load.items():
        for link, v in links.items():
            rows.append(f"{side:8} {link:11} {v / 1e9:9.1f} {load.utilization[side][link]:6.2f}")
    side, link, u = load.bottleneck()
    rows.append(f"busiest: {side} {link} at {u:.2f}" + ("  (saturated)" if u > 1 + 1e-9 else ""))
    return "\n".join(rows)


def as_fraction(x: float) -> str:
    return str(Fraction(x).limit_denominator(64)) if x != float("inf") else "inf"


def link_utilization(caps: dict[str, float], carried: dict[str, float], seconds: float) -> dict[str, float]:
    """Mean utilization of each kind of link on each side (``prefill snic``, ``decode cnic_write``, ...) over
    ``seconds``, from the bytes each simulated link carried."""
    used: dict[str, list[float]] = {}
    for link, cap in caps.items():
        if "/" not in link:
            continue
        side = PREFILL if link.startswith("p") else DECODE
        used.setdefault(f"{side} {link.rsplit('/', 1)[1]}", []).append(carried.get(link, 0.0) / (cap * seconds))
    return {k: sum(v) / len(v) for k, v in used.items()}


def simulate_split(
    hw: Hardware,
    model,
    prefill: int,
    decode: int,
    rounds,
    seconds: float,
    system: str = "dualpath",
    storage_gbps: float | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    engine=None,
) -> dict:
    """One P/D split under a closed loop of agents (``rounds``) for ``seconds`` of simulated time: turns/s over
    the second half, prefill GPU busy fraction and link utilizations (the whole run). ``storage_gbps``: the
    storage system's aggregate read rate (None or 0: unlimited); ``*_tp``: GPUs per engine of each role;
    ``engine``: one GPU's timings (default the preset's)."""
    from dualpath.sim.cluster import ClusterSim, SimConfig, storage_bps

    storage = storage_bps(storage_gbps)
    sim = ClusterSim(
        SimConfig(
            hw,
            model,
            engine or model.engine,
            prefill,
            decode,
            system,
            storage,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
        ),
        rounds,
    )
    r = sim.run(until=seconds)
    done = sum(1 for t in r.tpot_at if t >= seconds / 2)
    util = link_utilization(sim.loop.net.capacity, r.link_bytes, seconds)
    busiest = max(util, key=util.get)
    return {
        "prefill": prefill,
        "decode": decode,
        "turns_per_s": done / (seconds / 2),
        "prefill_busy": sim.prefill_busy_by(seconds) / (prefill * hw.gpus * seconds),
        "ttft_mean_s": sum(r.ttft_s) / len(r.ttft_s) if r.ttft_s else 0.0,
        "busiest": busiest,
        "busiest_utilization": util[busiest],
        "utilization": util,
    }


def simulate_splits(
    hw: Hardware, model, splits: list[tuple[int, int]], rounds, seconds: float, jobs: int = 1, **kw
) -> Iterator[dict]:
    """``simulate_split`` of each (prefill, decode) in ``splits``, in their order, each as it is ready: on ``jobs``
    forked processes (the runs share nothing; each is one core's work)."""
    run = partial(_simulate_pair, hw, model, rounds, seconds, kw)
    if jobs <= 1 or len(splits) <= 1:
        yield from map(run, splits)
        return
    with multiprocessing.get_context("fork").Pool(min(jobs, len(splits))) as pool:
        yield from pool.imap(run, splits)


def _simulate_pair(hw: Hardware, model, rounds, seconds: float, kw: dict, split: tuple[int, int]) -> dict:
    return simulate_split(hw, model, split[0], split[1], rounds, seconds, **kw)


def best_split(rows: list[dict]) -> dict:
    """The split with the most turns per second (ties: fewer prefill nodes)."""
    return max(rows, key=lambda r: (round(r["turns_per_s"], 6), -r["prefill"]))
