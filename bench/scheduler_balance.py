"""Storage-read balance across nodes: the DualPath policy against round-robin on the same agentic workload.

The real scheduler core drives simulated engines of a 2P4D cluster (8 engines per node, one storage NIC per node):
agents replay multi-turn trajectories (the paper's 64K-trace shape, scaled down), each turn's hit read from storage
on the side the policy picks, at the node's read bandwidth; engines report their loads (read queue, tokens, free
memory, bytes read) as real engines do and their groups pull, with jittered periods. Reported: storage reads per
node and their max/avg over nodes (the paper: 1.18 with its scheduler, 1.53 with round-robin), when the workload
is storage-bound and under a light load.

    python bench/scheduler_balance.py [--agents 256] [--seconds 120] [--out bench/results/scheduler_balance.json]
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_result  # noqa: E402

BS = 64
DT = 0.005  # simulation step, seconds
PULL_INTERVAL = 0.02  # a group's pull period, seconds


class Sim:
    def __init__(self, policy: str, args, seed: int):
        from dualpath.core.config import SchedulerConfig
        from dualpath.core.messages import EngineInfo, Role
        from dualpath.scheduler.core import SchedulerCore
        from dualpath.scheduler.policies import make_policy

        self.args, self.rng = args, random.Random(seed)
        self.core = SchedulerCore(
            SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9, max_queued_requests=10**6),
            make_policy(policy),
            clock=lambda: self.now,
            balance_window_s=10.0,
        )
        self.now = 0.0
        self.fp = b"\x03" * 16
        self.read_tps = args.read_tokens_per_s  # one node's storage NIC, in tokens/s
        alpha = int(self.read_tps * 3)
        self.nodes, self.engines = {}, {}
        for role, count in ((Role.PREFILL, args.prefill_nodes), (Role.DECODE, args.decode_nodes)):
            for n in range(count):
                node = f"{role.value[0]}n{n}"
                self.nodes[node] = {"queue": [], "read": 0}  # FIFO of [tokens left, request]
                for i in range(8):
                    eid = f"{node}-{i}"
                    cap = 10**7 if role is Role.DECODE else 64_000
                    beta = int(args.prefill_tokens_per_s * 5) if role is Role.PREFILL else 0
                    self.engines[eid] = {
                        "info": EngineInfo(
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
                            self.fp.hex(),
                            cap,
                            max_model_len=10**6,
                            group_id=node,
                            alpha_tokens=alpha,
                            beta_tokens=beta,
                        ),
                        "work": {},
                        "finished": [],
                        "busy_until": 0.0,
                    }
                    self.core.register(self.engines[eid]["info"])
        self.index_all = True
        self.events: list = []  # (time, seq, kind, payload)
        self.seq = 0

    def at(self, t, kind, payload):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def submit(self, agent):
        from dualpath.core.messages import SubmitRequest, pack_tokens
        from dualpath.core.sampling_params import SamplingParams

        n = agent["context"] + agent["append"]
        tokens = pack_tokens([0] * n)
        hit_blocks = agent["context"] // BS
        hashes = b"".join(((agent["id"] << 32) + i).to_bytes(16, "little") for i in range(n // BS))
        self.core.index.add(hashes[i : i + 16] for i in range(0, hit_blocks * 16, 16))
        rid = f"a{agent['id']}-t{agent['turn']}"
        agent["rid"] = rid
        self.core.submit(
            SubmitRequest(rid, tokens, SamplingParams(max_tokens=agent["gen"]).to_dict(), block_hashes=hashes),
            lambda ev: None,
            trust_hashes=True,
        )

    def run(self) -> dict:
        args = self.args
        agents = []
        for i in range(args.agents):
            ctx = self.rng.randint(args.context // 4, args.context * 2) // BS * BS
            agents.append(
                {
                    "id": i,
                    "context": ctx,
                    "append": self.rng.randint(200, 700),
                    "gen": self.rng.randint(100, 250),
                    "turn": 0,
                }
            )
            self.at(self.rng.uniform(0, 2.0), "submit", agents[-1])
        groups = sorted({e["info"].group_id for e in self.engines.values()})
        next_pull = {g: self.rng.uniform(0, PULL_INTERVAL) for g in groups}
        step = 0
        while self.now < args.seconds:
            while self.events and self.events[0][0] <= self.now:
                _, _, kind, payload = heapq.heappop(self.events)
                if kind == "submit":
                    self.submit(payload)
            self._storage()
            for g in groups:  # groups pull on their own clocks, with the jitter real pull loops have
                if self.now >= next_pull[g]:
                    self._pull(g, agents)
                    next_pull[g] = self.now + PULL_INTERVAL * self.rng.uniform(0.5, 1.5)
            self.now += DT
            step += 1
        reads = {n: v["read"] for n, v in self.nodes.items()}
        return reads

    def _storage(self):
        """Each node reads its queue at its NIC's rate (FIFO); a request is ready when both sides finished."""
        for node, st in self.nodes.items():
            budget = self.read_tps * DT
            while st["queue"] and budget > 0:
                item = st["queue"][0]
                take = min(item[0], budget)
                item[0] -= take
                budget -= take
                st["read"] += take
                if item[0] <= 0:
                    st["queue"].pop(0)
                    item[1]["pending"] -= 1

    def _load(self, e):
        from dualpath.core.messages import EngineLoad

        node = self.nodes[e["info"].node_id]
        read_q = int(sum(x[0] for x in node["queue"]) / 8)  # each engine reports its share of the node queue
        read_now = node["read"] / 8
        read_delta, e["read_reported"] = read_now - e.get("read_reported", 0.0), read_now
        work = e["work"]
        tok = sum(w["tok"] for w in work.values())
        finished, e["finished"] = e["finished"], []
        used = sum(w["reserve"] for w in work.values())
        return EngineLoad(
            e["info"].engine_id,
            len(work),
            tok,
            read_q,
            e["info"].capacity_tokens - used,
            request_ids=list(work),
            finished=finished,
            storage_read_bytes=int(read_delta),
        )

    def _pull(self, group, agents):
        from dualpath.core.messages import ReadPath

        members = [e for e in self.engines.values() if e["info"].group_id == group]
        self._progress(members, agents)
        reply = self.core.pull(group, [self._load(e) for e in members], members[0]["info"].engine_id)
        for eid, work in reply.assignments.items():
            for a in work:
                n = len(a.tokens) // 4
                hit = a.num_hit_blocks * BS
                pe, de = self.engines[eid], self.engines[a.decode.engine_id]
                req = {
                    "id": a.request_id,
                    "pending": 0,
                    "miss": n - hit,
                    "pe": pe,
                    "de": de,
                    "n": n,
                    "gen": next(x["gen"] for x in agents if x.get("rid") == a.request_id.rsplit(".", 1)[0]),
                }
                pe_share = hit if a.path is ReadPath.PE else max(0, a.split_pe_blocks) * BS
                for node, share in ((pe["info"].node_id, pe_share), (de["info"].node_id, hit - pe_share)):
                    if share > 0:
                        self.nodes[node]["queue"].append([share, req])
                        req["pending"] += 1
                pe["work"][a.request_id] = {"tok": n - hit, "reserve": 0, "req": req, "stage": "prefill"}
                de["work"][a.request_id] = {"tok": n, "reserve": n + req["gen"], "req": req, "stage": "wait"}

    def _progress(self, members, agents):
        """Prefill runs once a request's reads are done (one at a time per engine); decode finishes after its
        generation time; then the agent's next turn is submitted."""
        for e in members:
            for wid, w in list(e["work"].items()):
                req = w["req"]
                if w["stage"] == "prefill" and req["pending"] == 0 and e["busy_until"] <= self.now:
                    e["busy_until"] = self.now + req["miss"] / self.args.prefill_tokens_per_s
                    w["stage"] = "running"
                    w["done_at"] = e["busy_until"]
                elif w["stage"] == "running" and self.now >= w["done_at"]:
                    del e["work"][wid]
                    req["de"]["work"][wid]["stage"] = "decode"
                    req["de"]["work"][wid]["done_at"] = self.now + req["gen"] * self.args.tpot
                elif w["stage"] == "decode" and self.now >= w["done_at"]:
                    del e["work"][wid]
                    e["finished"].append(wid)
                    agent = agents[int(wid.split("-")[0][1:])]
                    agent["context"] = (agent["context"] + agent["append"] + agent["gen"]) // BS * BS
                    agent["turn"] += 1
                    agent["append"] = self.rng.randint(200, 700)
                    self.at(self.now, "submit", agent)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--prefill-nodes", type=int, default=2)
    ap.add_argument("--decode-nodes", type=int, default=4)
    ap.add_argument("--context", type=int, default=16_000)
    ap.add_argument("--read-tokens-per-s", type=float, default=150_000.0)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    ap.add_argument("--tpot", type=float, default=0.03)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dualpath.scheduler.balance import max_over_avg

    rows = []
    # storage-bound (the paper's regime: reads outrun the storage NICs), then a light load where queues stay short
    for load, read_tps in (("storage-bound", args.read_tokens_per_s), ("light", args.read_tokens_per_s * 3)):
        for policy in ("dualpath", "round-robin"):
            reads = Sim(policy, argparse.Namespace(**{**vars(args), "read_tokens_per_s": read_tps}), seed=0).run()
            rows.append(
                {
                    "load": load,
                    "policy": policy,
                    "read_max_over_avg": max_over_avg(reads.values()),
                    "read_Mtokens_per_s": sum(reads.values()) / args.seconds / 1e6,
                    **{f"read_{n}": round(v / 1e6, 2) for n, v in sorted(reads.items())},
                }
            )
    print_table(rows, list(rows[0]))
    result = {
        "cluster": f"{args.prefill_nodes}P{args.decode_nodes}D x 8 engines",
        "args": vars(args),
        "rows": rows,
        "targets": "dualpath max/avg <= 1.2 and below round-robin (paper: 1.18 vs 1.53)",
    }
    print("wrote", write_result("scheduler_balance", result, args.out))
    return result


if __name__ == "__main__":
    main()
