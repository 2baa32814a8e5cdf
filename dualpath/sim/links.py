"""The links each KV read path crosses, and the load both paths put on every link of a P/D cluster.

One byte of hit KV read from storage crosses, on its way to decode (paper §2, DESIGN §5):

* PE path: prefill SNIC -> prefill DRAM buffer -> (loopback RDMA through the GPU's CNIC) prefill HBM -> prefill
  CNIC -> decode CNIC -> decode DRAM buffer -> (loopback) decode HBM.
* DE path: decode SNIC -> decode DRAM buffer -> decode CNIC -> prefill CNIC -> prefill HBM; and at decode start
  the decode buffer's copy -> (loopback) decode HBM.

All GPU traffic, local copies included, goes through the GPU's paired CNIC (§5), so a loopback copy counts once on
the CNIC's read side and once on its write side. The miss tokens' KV (1-2% of a turn) is left out, as in §4.2.
The simulator charges single transfers to the same crossings; this module sums steady-state rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.sim.hardware import Hardware

PREFILL, DECODE = "prefill", "decode"
LINKS = ("snic", "dram", "cnic_read", "cnic_write")

# (side, link, bytes crossing per byte of hit KV)
PE_PATH = (
    (PREFILL, "snic", 1),
    (PREFILL, "dram", 2),  # SNIC writes the buffer, the CNIC reads it
    (PREFILL, "cnic_read", 1),
    (PREFILL, "cnic_write", 1),  # loopback: buffer -> HBM
    (PREFILL, "cnic_read", 1),
    (DECODE, "cnic_write", 1),  # prefill HBM -> decode buffer
    (DECODE, "dram", 1),  # ... written into the decode buffer
    (DECODE, "dram", 1),
    (DECODE, "cnic_read", 1),
    (DECODE, "cnic_write", 1),
)  # decode start: buffer -> HBM
DE_PATH = (
    (DECODE, "snic", 1),
    (DECODE, "dram", 1),  # SNIC writes the decode buffer
    (DECODE, "dram", 1),
    (DECODE, "cnic_read", 1),
    (PREFILL, "cnic_write", 1),  # buffer -> prefill HBM
    (DECODE, "dram", 1),
    (DECODE, "cnic_read", 1),
    (DECODE, "cnic_write", 1),
)  # decode start: buffer -> HBM


@dataclass(frozen=True)
class LinkLoad:
    """Per-node load (bytes/s) and utilization of each link, for the prefill and the decode nodes."""

    load: dict[str, dict[str, float]]
    utilization: dict[str, dict[str, float]]

    def bottleneck(self) -> tuple[str, str, float]:
        """(side, link, utilization) of the busiest link."""
        return max(
            ((side, link, u) for side, links in self.utilization.items() for link, u in links.items()),
            key=lambda t: t[2],
        )

    def saturated(self, tolerance: float = 1e-9) -> list[tuple[str, str, float]]:
        return [(s, l, u) for s, links in self.utilization.items() for l, u in links.items() if u > 1 + tolerance]


def capacity(hw: Hardware, link: str) -> float:
    """A node's capacity on ``link``: CNIC traffic spreads over all the node's GPUs (load balanced)."""
    return {
        "snic": hw.snic_bps,
        "dram": hw.dram_bps,
        "cnic_read": hw.gpus * hw.cnic_bps,
        "cnic_write": hw.gpus * hw.cnic_bps,
    }[link]


def link_load(
    hw: Hardware,
    prefill_nodes: int,
    decode_nodes: int,
    pe_read_bps: float | None = None,
    de_read_bps: float | None = None,
) -> LinkLoad:
    """Steady-state per-node link loads when every prefill node reads ``pe_read_bps`` of hit KV from storage (PE
    path) and every decode node ``de_read_bps`` (DE path); default: every storage NIC saturated, the state §4.2
    analyses. Traffic is spread evenly over the nodes of each side."""
    if prefill_nodes < 1 or decode_nodes < 1:
        raise ValueError("need at least one prefill and one decode node")
    pe = hw.snic_bps if pe_read_bps is None else pe_read_bps
    de = hw.snic_bps if de_read_bps is None else de_read_bps
    nodes = {PREFILL: prefill_nodes, DECODE: decode_nodes}
    total = {PREFILL: pe * prefill_nodes, DECODE: de * decode_nodes}  # bytes/s entering each path, cluster-wide
    load = {side: dict.fromkeys(LINKS, 0.0) for side in nodes}
    for origin, path in ((PREFILL, PE_PATH), (DECODE, DE_PATH)):
        for side, link, factor in path:
            load[side][link] += factor * total[origin] / nodes[side]
    util = {side: {link: v / capacity(hw, link) for link, v in links.items()} for side, links in load.items()}
    return LinkLoad(load, util)


def cluster_links(hw: Hardware, nodes: list[str]) -> dict[str, float]:
    """Every link of ``nodes`` by name: ``node/snic``, ``node/dram``, ``node/gpuI/cnic_read|cnic_write``."""
    caps = {}
    for n in nodes:
        caps[f"{n}/snic"], caps[f"{n}/dram"] = hw.snic_bps, hw.dram_bps
        for i in range(hw.gpus):
            caps[f"{n}/gpu{i}/cnic_read"] = caps[f"{n}/gpu{i}/cnic_write"] = hw.cnic_bps
    return caps


def path_route(
    path, prefill: tuple[str, int], decode: tuple[str, int], prefill_ranks: int = 1, decode_ranks: int = 1
) -> tuple[tuple[str, float], ...]:
    """The links one request's hit KV crosses on ``path`` (PE_PATH or DE_PATH) between a prefill engine and a decode
    engine, each (node, first GPU index) with its ranks on that GPU and the next ``*_ranks - 1``, with the factors of
    repeated crossings summed. Each rank moves its heads' slice, 1/ranks of the bytes, through its own CNIC (DESIGN
    §1); the node's SNIC and DRAM carry all of it. One flow over the whole route is the fluid view of a
    layer-pipelined transfer: every stage moves at the pace of the slowest."""
    route: dict[str, float] = {}
    for side, link, factor in path:
        (node, gpu), ranks = (prefill, prefill_ranks) if side == PREFILL else (decode, decode_ranks)
        if link in ("snic", "dram"):
            names = ((f"{node}/{link}", factor),)
        else:
            names = tuple((f"{node}/gpu{gpu + r}/{link}", factor / ranks) for r in range(ranks))
        for name, f in names:
            route[name] = route.get(name, 0.0) + f
    return tuple(route.items())
