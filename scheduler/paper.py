"""The DualPath paper's inter-engine scheduling (§6, App. A.4), as pure policy.

Prefill (Algorithm 1), when a prefill group pulls, for the head of the FIFO queue: classify the group's engines
into C1 = {tok > β} (overloaded: skipped), C2 = {read_q ≤ α, tok ≤ β} and C3 = {read_q > α, tok ≤ β}, where
read_q is the engine's node storage read queue, α the tokens that node reads in 3 s and β the tokens one device
prefills in 5 s; give the request to the least-``tok`` engine of C2, else of C3, else stop the fetch; charge it
and re-classify for the next request.

Decode, phase 1: each request goes to the decode group with the least total tokens (its private queue). Phase 2,
when the group pulls: R is the longest prefix of the private queue that fits the group's summed free memory,
Z = 1.05 × (Σ_{r∈R} len_r + Σ_e tok_e) / |E|; the head goes, among engines with room, to the fewest-``seq`` engine
that stays under Z, else to the least-``tok`` one; with no room anywhere the pull stops.

Read path: the side whose node has the shorter read queue.

Sessions (beyond the paper): a turn of an agent session prefers the engine holding a prefetch of its KV, and its last
decode engine, but only among the engines the rules above allow: Algorithm 1's chosen class, phase 2's engines
under Z (``dualpath.scheduler.policy.preferred``). It then reads where the prefetch is.
"""

from __future__ import annotations

from dualpath.scheduler.policy import EngineState, NodeState, Policy, preferred, take_decode

INF = float("inf")
_UNKNOWN_NODE = NodeState()  # read only: what classify assumes of a node with no report


def overloaded(e: EngineState) -> bool:
    """C1 of Algorithm 1: tok > β. An unknown β (0) never excludes an engine."""
    return e.tok > (e.beta or INF)


def classify(engines: list[EngineState], nodes: dict[str, NodeState], pe_nodes: dict[str, str]):
    """(C1, C2, C3) of Algorithm 1. Unknown α or β (0) never excludes an engine."""
    c1, c2, c3 = [], [], []
    for e in engines:
        node = nodes.get(pe_nodes[e.engine_id]) or _UNKNOWN_NODE
        alpha = node.alpha or INF
        if overloaded(e):
            c1.append(e)
        elif node.read_q <= alpha:
            c2.append(e)
        else:
            c3.append(e)
    return c1, c2, c3


class DualPathPolicy(Policy):
    name = "dualpath"
    global_view = False  # Algorithm 1 looks at the pulling group only

    def __init__(self, z_factor: float = 1.05):
        self.z_factor = z_factor

    def assign_prefill(self, queue, engines, pulling, nodes, pe_nodes, block_size):
        group = [e for e in engines if e.engine_id in pulling]
        out = []
        for r in queue:
            _, c2, c3 = classify(group, nodes, pe_nodes)
            pool = c2 or c3
            if not pool:
                break  # every engine of the group is overloaded: stop this fetch
            e = preferred(r, pool, self.affinity, "pe") or min(pool, key=lambda e: (e.tok, e.engine_id))
            out.append(self.place_prefill(r, e, nodes, pe_nodes[e.engine_id], block_size))
        return out

    def takes_no_prefill(self, group):
        return all(map(overloaded, group))  # C2 and C3 empty: every fetch stops at once

    def assign_decode(self, queue, engines, pulling):
        group = [e for e in engines if e.engine_id in pulling]
        if not group:
            return []
        free, fitting, prefix = sum(max(0, e.free_tokens) for e in group), 0, []
        for r in queue:
            if fitting + r.reserve_tokens > free:
                break
            fitting += r.reserve_tokens
            prefix.append(r)
        z = self.z_factor * (sum(r.num_tokens for r in prefix) + sum(e.tok for e in group)) / len(group)
        out = []
        for r in queue:
            room = [e for e in group if e.free_tokens >= r.reserve_tokens]
            if not room:
                break
            under = [e for e in room if e.tok + r.num_tokens <= z]
            e = (
                (preferred(r, under, self.affinity, "de") or min(under, key=lambda e: (e.seq, e.engine_id)))
                if under
                else min(room, key=lambda e: (e.tok, e.engine_id))
            )
            take_decode(e, r)
            out.append((r.request_id, e.engine_id))
        return out
