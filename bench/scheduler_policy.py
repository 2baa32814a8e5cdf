"""How fast the scheduler decides, on one core, at the paper's largest scale: 48P96D (144 nodes, 8 devices each:
384 prefill and 768 decode engines) with 48,000 active agents.

(a) the pure policy (DualPath: phase 1 routing, phase 2 per decode group, Algorithm 1 per prefill group, read path)
    placing one second of the paper's offline load (2,400 requests of ~33K tokens, 98.7% hits);
(b) the whole scheduler core (submission with hit lookup, queues, pulls with load reports) doing the same.

    python bench/scheduler_policy.py [--out bench/results/scheduler_policy.json]
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_result  # noqa: E402

PE_NODES, DE_NODES, PER_NODE = 48, 96, 8
AGENTS, REQUESTS, BS = 48_000, 2_400, 64
CONTEXT, APPEND, GEN = 32_721, 429, 176  # the paper's 64K trace: average context, append and generation


def states(rng):
    from dualpath.scheduler.policy import EngineState, NodeState

    pes = [
        EngineState(f"p{n}-{i}", f"pn{n}", f"pn{n}", seq=rng.randint(0, 4), tok=rng.randint(0, 15_000), beta=20_000)
        for n in range(PE_NODES)
        for i in range(PER_NODE)
    ]
    per_de = AGENTS // (DE_NODES * PER_NODE)
    des = [
        EngineState(
            f"d{n}-{i}",
            f"dn{n}",
            f"dn{n}",
            seq=per_de,
            tok=per_de * CONTEXT + rng.randint(0, 10_000),
            free_tokens=600_000 + rng.randint(0, 100_000),
        )
        for n in range(DE_NODES)
        for i in range(PER_NODE)
    ]
    nodes = {f"pn{n}": NodeState(rng.randint(0, 100_000), 50_000) for n in range(PE_NODES)}
    nodes.update({f"dn{n}": NodeState(rng.randint(0, 100_000), 50_000) for n in range(DE_NODES)})
    return pes, des, nodes


def requests(rng):
    from dualpath.scheduler.policy import QueuedRequest

    out = []
    for i in range(REQUESTS):
        n = CONTEXT + rng.randint(-2000, 2000)
        hit = (n - APPEND) // BS * BS
        out.append(QueuedRequest(f"r{i}", n, hit, n + GEN))
    return out


def bench_policy(name: str, rng) -> dict:
    from dataclasses import replace

    from dualpath.scheduler.policies import make_policy

    policy = make_policy(name)
    pes, des, nodes = states(rng)
    reqs = requests(rng)
    pe_nodes = {e.engine_id: e.node_id for e in pes}
    de_groups: dict[str, list] = {}
    for e in des:
        de_groups.setdefault(e.group_id, []).append(e)
    pe_groups: dict[str, list] = {}
    for e in pes:
        pe_groups.setdefault(e.group_id, []).append(e)
    t = time.perf_counter()
    totals = {g: sum(e.tok for e in es) for g, es in de_groups.items()}
    private: dict[str, list] = {g: [] for g in de_groups}
    for r in reqs:  # phase 1
        g = policy.route_decode_group(r, totals)
        private[g].append(r)
        totals[g] += r.num_tokens
    placed = {}
    for g, queue in private.items():  # phase 2, each group's pull
        for rid, eid in policy.assign_decode(queue, de_groups[g], {e.engine_id for e in de_groups[g]}):
            placed[rid] = eid
    de_node = {e.engine_id: e.node_id for e in des}
    prefill_queue = [replace(r, decode_node=de_node[placed[r.request_id]]) for r in reqs if r.request_id in placed]
    decisions = 0
    for _ in range(3):  # prefill groups pull in turn until the queue is drained (or everyone is full)
        for g, es in pe_groups.items():
            if not prefill_queue:
                break
            engines = es if not getattr(policy, "global_view", True) else pes
            out = policy.assign_prefill(prefill_queue, engines, {e.engine_id for e in es}, nodes, pe_nodes, BS)
            decisions += len(out)
            done = {d.request_id for d in out}
            prefill_queue = [r for r in prefill_queue if r.request_id not in done]
    elapsed = time.perf_counter() - t
    return {
        "what": f"policy {name}",
        "requests": REQUESTS,
        "decode_placed": len(placed),
        "prefill_placed": decisions,
        "seconds": elapsed,
        "requests_per_s": decisions / elapsed,
    }


def bench_core(rng) -> dict:
    from dualpath.core.config import SchedulerConfig
    from dualpath.core.geometry import block_hashes
    from dualpath.core.messages import EngineInfo, EngineLoad, Role, SubmitRequest, pack_keys, pack_tokens
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.scheduler.core import SchedulerCore
    from dualpath.scheduler.policies import make_policy

    core = SchedulerCore(SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9), make_policy("dualpath"))
    fp = b"\x01" * 16

    def info(eid, role, node, cap, beta=0):
        return EngineInfo(
            eid,
            role,
            node,
            "x:1",
            "shm",
            {},
            [],
            1,
            64,
            BS,
            61,
            fp.hex(),
            cap,
            max_model_len=200_000,
            group_id=node,
            alpha_tokens=50_000,
            beta_tokens=beta,
        )

    engines = [
        info(f"p{n}-{i}", Role.PREFILL, f"pn{n}", 64_000, 20_000) for n in range(PE_NODES) for i in range(PER_NODE)
    ]
    engines += [info(f"d{n}-{i}", Role.DECODE, f"dn{n}", 2_800_000) for n in range(DE_NODES) for i in range(PER_NODE)]
    for e in engines:
        core.register(e)
    groups: dict[str, list] = {}
    for e in engines:
        groups.setdefault(e.group_id, []).append(e)
    per_de = AGENTS // (DE_NODES * PER_NODE)
    held: dict[str, dict[str, int]] = {e.engine_id: {} for e in engines}

    def load(e):
        h = held[e.engine_id]
        base = per_de * CONTEXT if e.role is Role.DECODE else 0
        return EngineLoad(
            e.engine_id,
            len(h),
            base + sum(h.values()),
            rng.randint(0, 60_000),
            e.capacity_tokens - base - sum(h.values()),
            request_ids=list(h),
        )

    subs = []
    for i in range(REQUESTS):  # what frontends send: packed tokens and the hashes they computed
        n = CONTEXT + rng.randint(-2000, 2000)
        toks = np.random.default_rng(i).integers(0, 50_000, n).tolist()
        subs.append(
            SubmitRequest(
                f"r{i}",
                pack_tokens(toks),
                SamplingParams(max_tokens=GEN).to_dict(),
                block_hashes=pack_keys(block_hashes(toks, fp, BS)),
                fingerprint=fp.hex(),
            )
        )
    core.index.add(
        h for s in subs for h in [s.block_hashes[j : j + 16] for j in range(0, len(s.block_hashes), 16)][:-7]
    )
    t = time.perf_counter()
    for s in subs:
        core.submit(s, lambda ev: None, member=True)  # a cluster member's hashes: used, 1 in 64 checked
    t_submit = time.perf_counter() - t
    assigned = pulls = 0
    order = sorted(groups, key=lambda g: not g.startswith("dn"))  # decode groups first, as their pulls come
    while assigned < REQUESTS and pulls < 20 * len(groups):
        for g in order:
            reply = core.pull(g, [load(e) for e in groups[g]], groups[g][0].engine_id)
            pulls += 1
            for eid, work in reply.assignments.items():
                for a in work:
                    held[eid][a.request_id] = len(a.tokens) // 4 - a.num_hit_blocks * BS
                    assigned += 1
    elapsed = time.perf_counter() - t
    return {
        "what": "scheduler core (dualpath)",
        "requests": REQUESTS,
        "prefill_placed": assigned,
        "pulls": pulls,
        "submit_seconds": t_submit,
        "seconds": elapsed,
        "requests_per_s": assigned / elapsed,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [bench_policy("dualpath", random.Random(0)), bench_core(random.Random(0))]
    print_table(rows, ["what", "requests", "prefill_placed", "seconds", "requests_per_s"])
    result = {
        "cluster": "48P96D, 8 devices per node",
        "active_agents": AGENTS,
        "rows": rows,
        "paper_rate_requests_per_s": 2400,
    }
    print("wrote", write_result("scheduler_policy", result, args.out))
    return result


if __name__ == "__main__":
    main()
