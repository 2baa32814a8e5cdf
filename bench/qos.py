"""Model collectives against a KV flood on one shaped link, without and with priority classes (paper §5: KV on a
low-priority lane never slows the collectives).

Two hosts on this machine: two network namespaces joined by a veth pair. Each side's egress is shaped with ``tc``
``htb`` to a fixed rate, with three classes under it that ``u32`` filters fill by DSCP: the collectives' DSCP
(high: 90% of the rate assured, first to take spare capacity), KV's (low: 1% assured, takes what is left) and
anything else (default). That is what a fabric does with the same marks (an InfiniBand VL arbiter's weights, a
RoCE switch's ETS queues), on a link slow enough for this machine's two cores to fill. (This kernel has ``htb``
but no ``prio`` qdisc; ``htb``'s priorities give the same strict order here.)

- **Collectives**: two gloo ranks, one per side, run what one decode step of DeepSeek-V3 moves per layer at a
  small decode batch (``--tokens`` per rank; hidden 7168, bf16): the tensor-parallel all-reduce of the batch's
  hidden states and the expert-parallel all-to-all dispatching them (with two ranks almost every token has one of
  its 8 experts on the other rank, so each rank sends the other all of its tokens). ``--gap-ms`` of "compute"
  separates the layers. A collective's latency runs from the moment the last rank enters it to the moment the last
  rank leaves it (one clock: both ranks run on this machine).
- **KV flood**: the project's ``ucx`` transport (over TCP here) writes Layer Blocks (DeepSeek-V3's MLA: 64 tokens x
  576 x 2 bytes) continuously from an engine's transport on side a into another's on side b (a prefill node
  sending prompts' KV to a decode node; ``--directions both``: each way too), one layer's 14 blocks (a 896-token
  prompt) per write, over ``--lanes`` peer lanes (an engine writes to several peers at once). KV throughput is
  the payload of the writes completed while the collectives ran; its share is of the link rate the collectives
  leave (the link's rate less their bytes on the wire, headers included: a conservative ratio, payload against
  wire bytes).
- **Marks**: the KV transport marks its own sockets from ``TransportConfig.kv_traffic_class`` (``dualpath.traffic.qos``);
  gloo has no TOS option, so the ranks mark their sockets themselves after the group forms (what a host rule does
  for a real cluster's TCP collectives, ``deploy/qos/README.md``).

Cases, in ``--rounds`` interleaved rounds (the machine's other load falls on all of them alike; latencies
pooled): the collectives ``alone``; under the flood with ``no_priorities`` (``QosConfig.off()``: nothing marked,
everything shares the default class's one FIFO); under the flood ``with_priorities`` (``QosConfig()``:
collectives DSCP 26, KV DSCP 10); and the flood alone (``kv_alone``, what KV gets of a free link). Target: with
priorities, each collective's p99 at most 1.2x its p99 alone, while KV keeps at least 80% of the link rate the
collectives leave. The ranks run at nice -10 in every case: on a cluster NICs move KV and GPUs run the
collectives, here two shared cores do both, and the ranks come first on them as their packets do on the link.

    sudo python bench/qos.py [--rate-mbit 200] [--iters 150 --rounds 3] [--quick] [--out bench/results/qos.json]

Needs root (namespaces, tc), iproute2, ethtool and ucxx. Writes bench/results/qos.json and qos.png (qos.svg without
matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

HIDDEN = 7168  # DeepSeek-V3 hidden size
DTYPE_BYTES = 2  # bf16 activations (the collectives move float16 tensors of the same size: gloo reduces them)
KV_BLOCK_BYTES = 64 * (512 + 64) * 2  # one MLA Layer Block: 64 tokens x (kv_lora_rank + rope_dim) x bf16
BLOCKS_PER_WRITE = 14  # one layer's KV of a 896-token prompt: what a prefill engine sends per layer (~1 MB)
WRITES_QUEUED = 3  # per lane: a lane moves one write at a time, the next ones wait in its queue
REGION_BYTES = 64 << 20
CASES = ("alone", "no_priorities", "with_priorities", "kv_alone")


def _now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on this machine


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the two hosts ------------------------------------------------------------------------------------------------
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def missing() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    for tool in ("ip", "tc", "ethtool"):
        if not shutil.which(tool):
            return f"needs {tool}"
    try:
        import ucxx  # noqa: F401
    except ImportError:
        return "needs ucxx (the ucx transport)"
    return None


class Link:
    """Namespaces ``a`` and ``b`` joined by one veth pair; ``shape`` puts the rate and the priority classes on both
    ends' egress. Everything it made goes in ``down`` (also after a failure half-way)."""

    def __init__(self, kv_dscp: int, collective_dscp: int):
        tag = os.getpid() % 100000
        net = f"10.214.{tag % 250}"
        self.ns = {"a": f"dpqos{tag}a", "b": f"dpqos{tag}b"}
        self.dev = {"a": "qosa", "b": "qosb"}
        self.ip = {"a": f"{net}.1", "b": f"{net}.2"}
        self.kv_dscp, self.collective_dscp = kv_dscp, collective_dscp
        self._made: list[str] = []

    def exec(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def up(self) -> "Link":
        try:
            for side in "ab":
                _sh("ip", "netns", "add", self.ns[side])
                self._made.append(self.ns[side])
            _sh(
                "ip",
                "link",
                "add",
                self.dev["a"],
                "netns",
                self.ns["a"],
                "type",
                "veth",
                "peer",
                "name",
                self.dev["b"],
                "netns",
                self.ns["b"],
            )
            for side in "ab":
                ns, dev = self.exec(side), self.dev[side]
                _sh(*ns, "ip", "addr", "add", f"{self.ip[side]}/24", "dev", dev)
                _sh(*ns, "ip", "link", "set", dev, "up")
                _sh(*ns, "ip", "link", "set", "lo", "up")
                # one packet per MTU through the qdisc: with segmentation offloads it would see 64 KB bursts and
                # strict priority would act at that grain
                _sh(*ns, "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", check=False)
        except BaseException:
            self.down()
            raise
        return self

    # the classes under the link's rate: (minor, share of the rate assured, HTB priority, DSCP it takes)
    CLASSES = {"high": (10, 0.90, 0), "default": (20, 0.09, 1), "low": (30, 0.01, 2)}

    def shape(self, rate_mbit: float, queue_packets: int) -> None:
        """``htb`` at ``rate_mbit`` on each side's egress, with three classes: the collectives' DSCP (high), KV's
        (low), anything else (default). Each is assured a share of the rate (90%, 9%, 1%: the paper's weighted
        arbitration keeps ~99% for high priority) and may take the whole rate when it is idle, spare capacity
        going to the highest priority first: in effect strict priority, KV taking what the others leave."""
        for side in "ab":
            ns, dev = self.exec(side), self.dev[side]
            tc = [*ns, "tc"]
            _sh(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
            _sh(
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                f"{rate_mbit}mbit",
                "ceil",
                f"{rate_mbit}mbit",
                "quantum",
                "3028",
            )
            for minor, share, prio in self.CLASSES.values():
                _sh(
                    *tc,
                    "class",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:1",
                    "classid",
                    f"1:{minor}",
                    "htb",
                    "rate",
                    f"{rate_mbit * share:g}mbit",
                    "ceil",
                    f"{rate_mbit}mbit",
                    "prio",
                    str(prio),
                    "quantum",
                    "3028",
                )
                _sh(
                    *tc,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    f"1:{minor}",
                    "handle",
                    f"{minor}0:",
                    "pfifo",
                    "limit",
                    str(queue_packets),
                )
            for prio, (dscp, cls) in enumerate(((self.collective_dscp, "high"), (self.kv_dscp, "low")), 1):
                _sh(
                    *tc,
                    "filter",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:",
                    "protocol",
                    "ip",
                    "prio",
                    str(prio),
                    "u32",
                    "match",
                    "ip",
                    "dsfield",
                    hex(dscp << 2),
                    "0xfc",
                    "flowid",
                    f"1:{self.CLASSES[cls][0]}",
                )

    def tx_bytes(self, side: str) -> int:
        return int(_sh(*self.exec(side), "cat", f"/sys/class/net/{self.dev[side]}/statistics/tx_bytes").stdout)

    def bands(self, side: str) -> dict[str, dict]:
        """Bytes, packets and drops of each priority class on ``side``'s egress so far."""
        out = json.loads(_sh(*self.exec(side), "tc", "-s", "-j", "qdisc", "show", "dev", self.dev[side]).stdout)
        names = {f"{minor}0:": name for name, (minor, *_) in self.CLASSES.items()}
        return {
            names[q["handle"]]: {"bytes": q.get("bytes", 0), "packets": q.get("packets", 0), "drops": q.get("drops", 0)}
            for q in out
            if q.get("handle") in names
        }

    def down(self) -> None:
        for ns in self._made:
            _sh("ip", "netns", "del", ns, check=False)  # takes its end of the veth, and so the pair, with it
        self._made.clear()


# --- workers (each in its namespace, talking JSON lines on stdin/stdout) -------------------------------------------
def _collective_worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dualpath.traffic import qos

    torch.set_num_threads(1)
    os.nice(args.collective_nice)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=2, timeout=timedelta(seconds=120)
    )
    n = args.tokens * HIDDEN
    reduce_in = torch.ones(n, dtype=torch.float16)
    a2a_in = torch.ones(2 * n, dtype=torch.float16)  # the batch's hidden states for each rank, this one's included
    a2a_out = torch.empty_like(a2a_in)
    for _ in range(3):  # the group's connections exist once each collective ran
        dist.all_reduce(reduce_in)
        dist.all_to_all_single(a2a_out, a2a_in)
    tos = args.dscp << 2
    marked = qos.mark_own_sockets(tos, lambda s: True) if tos else 0
    socks = [(s.local_port, s.remote_port, qos.fd_tos(s.fd)) for s in qos.own_tcp_sockets() if not s.listening]
    _emit({"ready": True, "marked": marked, "sockets": socks})
    sys.stdin.readline()  # go
    times = []
    for i in range(args.warmup + args.iters):
        time.sleep(args.gap_ms / 1000)  # the layer's compute
        t0 = _now()
        dist.all_reduce(reduce_in)
        t1 = _now()
        dist.all_to_all_single(a2a_out, a2a_in)
        t2 = _now()
        if i >= args.warmup:
            times.append((t0, t1, t2))
        if args.rank == 0 and (i + 1) % 25 == 0:
            _emit({"progress": i + 1 - args.warmup})
    dist.barrier()
    _emit({"times": times})
    dist.destroy_process_group()


def _kv_worker(args) -> None:
    import torch

    from dualpath.core.config import TransportConfig
    from dualpath.traffic import qos
    from dualpath.traffic.transport import Op, Priority, RegionDesc, Segment, make_transport

    torch.set_num_threads(1)
    os.nice(args.kv_nice)
    cfg = TransportConfig(name="ucx", host=args.ip, kv_traffic_class=args.dscp << 2, op_timeout_s=120)
    t = make_transport(cfg, f"kv-{args.ip}")
    mem = t.allocate(REGION_BYTES)
    mem.tensor.fill_(7)
    local = t.register(mem).region_id
    _emit({"address": t.address(), "regions": [r.to_dict() for r in t.regions()]})
    peers: list[str] = []
    if args.send:
        peer = json.loads(sys.stdin.readline())
        regions = [RegionDesc.from_dict(r) for r in peer["regions"]]
        remote = regions[0].region_id
        peers = [f"peer{k}" for k in range(args.lanes)]
        for p in peers:  # one lane (and one connection) per peer name, as an engine writing to several peers has
            t.add_peer(p, peer["address"], regions)
    sys.stdin.readline()  # go
    stop = threading.Event()
    done: list[tuple[float, int]] = []
    write = BLOCKS_PER_WRITE * KV_BLOCK_BYTES
    slots = REGION_BYTES // write

    errors: list[str] = []

    def flood():
        k, inflight = 0, []
        try:
            while not stop.is_set() or inflight:
                while not stop.is_set() and len(inflight) < WRITES_QUEUED * len(peers):
                    base = (k % slots) * write
                    segs = [
                        Segment(local, base + j * KV_BLOCK_BYTES, remote, base + j * KV_BLOCK_BYTES, KV_BLOCK_BYTES)
                        for j in range(BLOCKS_PER_WRITE)
                    ]
                    inflight.append(t.submit(peers[k % len(peers)], Op.WRITE, segs, Priority.LOW))
                    k += 1
                h = inflight.pop(0)
                h.wait(300)
                done.append((h.finished_at, h.nbytes))
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator
            errors.append(repr(e))

    th = threading.Thread(target=flood, daemon=True)
    if args.send:
        th.start()
    sys.stdin.readline()  # stop
    stop.set()
    if args.send:
        th.join(300)
    socks = [(s.local_port, s.remote_port, qos.fd_tos(s.fd)) for s in qos.own_tcp_sockets() if not s.listening]
    _emit({"done": done, "sockets": socks, "marked": t.kv_marker.marked, "errors": errors})
    sys.stdin.readline()  # exit: once the other side's writes into our region are done too
    t.close()
    mem.close()
    os._exit(0)


# --- the orchestrator ---------------------------------------------------------------------------------------------
class Worker:
    """A worker process in a namespace; ``recv`` reads its next JSON line (its stderr goes to a log file)."""

    def __init__(self, name: str, prefix: list[str], argv: list[str], log_dir: Path):
        self.name, self.log = name, log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_WARN_UNUSED_ENV_VARS": "n", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(Path(__file__).resolve()), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),
            text=True,
            env=env,
        )

    def send(self, obj) -> None:
        self.proc.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 120):
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"{self.name}: no answer in {timeout:.0f} s; its log:\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); its log:\n{self.tail()}")
        return json.loads(line)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run_case(case: str, link: Link, args, log_dir: Path, say) -> dict:
    """One round of ``case``: its workers started, the flood ramped up, the steps measured, everything stopped.
    Returns the raw measurements (``combine`` pools the rounds)."""
    from dualpath.core.config import QosConfig

    qos = QosConfig.off() if case == "no_priorities" else QosConfig()
    workers: list[Worker] = []
    try:
        kv = []
        if case != "alone":
            # a sender on each sending side writing into a receiver on the other (two engines' transports: the
            # receiver's replies never queue behind the sender's own writes in one TCP stream)
            pairs = [("a", "b")] if args.directions == "one" else [("a", "b"), ("b", "a")]
            for src, dst in pairs:
                recv = Worker(
                    f"{case}-kv-recv-{dst}",
                    link.exec(dst),
                    ["--worker", "kv", "--ip", link.ip[dst], "--dscp", str(qos.kv_dscp)],
                    log_dir,
                )
                send = Worker(
                    f"{case}-kv-send-{src}",
                    link.exec(src),
                    [
                        "--worker",
                        "kv",
                        "--ip",
                        link.ip[src],
                        "--dscp",
                        str(qos.kv_dscp),
                        "--send",
                        "--lanes",
                        str(args.lanes),
                        "--kv-nice",
                        str(args.kv_nice),
                    ],
                    log_dir,
                )
                kv += [recv, send]
                workers += [recv, send]
                info = [recv.recv(), send.recv()]
                send.send(info[0])
        coll = []
        if case != "kv_alone":
            port = 29500 + os.getpid() % 1000 * 4 + CASES.index(case)  # a fresh port each case
            for rank, side in enumerate("ab"):
                coll.append(
                    Worker(
                        f"{case}-rank{rank}",
                        link.exec(side),
                        [
                            "--worker",
                            "collective",
                            "--rank",
                            str(rank),
                            "--master",
                            f"{link.ip['a']}:{port}",
                            "--ifname",
                            link.dev[side],
                            "--dscp",
                            str(qos.collective_dscp),
                            "--tokens",
                            str(args.tokens),
                            "--iters",
                            str(args.iters),
                            "--warmup",
                            str(args.warmup),
                            "--gap-ms",
                            str(args.gap_ms),
                            "--collective-nice",
                            str(args.collective_nice),
                        ],
                        log_dir,
                    )
                )
            workers += coll
            ready = [w.recv() for w in coll]
        bands0 = {s: link.bands(s) for s in "ab"}
        for w in kv:
            w.send("go")
        if kv:
            time.sleep(args.kv_ramp_s)  # TCP and the lanes at full rate before the measurement
        tx0, t_start = {s: link.tx_bytes(s) for s in "ab"}, _now()
        raw: dict = {"ar": [], "a2a": []}
        if coll:
            for w in coll:
                w.send("go")
            while True:
                msg = coll[0].recv(timeout=600)
                if "times" in msg:
                    times = [msg["times"], coll[1].recv(timeout=120)["times"]]
                    break
                say(f"  {case}: {msg['progress']}/{args.iters} steps")
        else:
            time.sleep(args.kv_alone_s)
        t_end = _now()
        tx1 = {s: link.tx_bytes(s) for s in "ab"}
        bands1 = {s: link.bands(s) for s in "ab"}
        for w in kv:
            w.send("stop")
        kv_out = [w.recv(timeout=300) for w in kv]
        for w in kv:
            w.send("exit")
        for w, out in zip(kv, kv_out):
            if out["errors"]:
                raise RuntimeError(f"{w.name}: the KV flood failed: {out['errors'][0]}; its log:\n{w.tail()}")
        raw["link_tx_bytes"] = {s: tx1[s] - tx0[s] for s in "ab"}  # each side's egress; the warm-up steps' too
        raw["link_window_s"] = t_end - t_start
        raw["steps_on_link"] = args.warmup + args.iters if coll else 0
        if coll:
            # from the moment the last rank enters a collective to the moment the last one leaves it
            raw["ar"] = [max(a[1], b[1]) - max(a[0], b[0]) for a, b in zip(*times)]
            raw["a2a"] = [max(a[2], b[2]) - max(a[1], b[1]) for a, b in zip(*times)]
            t_start, t_end = min(x[0][0] for x in times), max(x[-1][2] for x in times)
            raw["collective_sockets_tos"] = sorted({tos for r in ready for *_, tos in r["sockets"]})
        raw["window_s"] = t_end - t_start  # the measured steps (KV's bytes are counted over the same)
        raw["kv_bytes"] = sum(n for out in kv_out for t, n in out["done"] if t_start <= t <= t_end)
        if kv:
            raw["kv_sockets_tos"] = sorted({tos for out in kv_out for *_, tos in out["sockets"]})
        raw["bands"] = {
            s: {b: {k: bands1[s][b][k] - bands0[s][b][k] for k in bands1[s][b]} for b in bands1[s]} for s in "ab"
        }
        return raw
    finally:
        for w in workers:
            w.stop()


def _directions(args) -> int:
    return 1 if args.directions == "one" else 2


def combine(case: str, parts: list[dict], args) -> dict:
    """One case's rounds as one result: latencies pooled, bytes and times summed."""
    from dualpath.core.config import QosConfig

    qos = QosConfig.off() if case == "no_priorities" else QosConfig()
    total = lambda key: sum(p[key] for p in parts)  # noqa: E731
    result: dict = {
        "case": case,
        "rounds": len(parts),
        "rate_mbit": args.rate_mbit,
        "qos": {"kv_dscp": qos.kv_dscp, "collective_dscp": qos.collective_dscp},
    }
    for name, key in (("all_reduce", "ar"), ("all_to_all", "a2a")):
        lat = [x for p in parts for x in p[key]]
        if lat:
            result[name] = {
                "p50_ms": 1e3 * statistics.median(lat),
                "p99_ms": 1e3 * _pct(lat, 99),
                "mean_ms": 1e3 * statistics.fmean(lat),
                "max_ms": 1e3 * max(lat),
                "n": len(lat),
                "p99_ms_per_round": [1e3 * _pct(p[key], 99) for p in parts],
            }
    result["window_s"] = total("window_s")
    result["link_tx_bytes"] = {s: sum(p["link_tx_bytes"][s] for p in parts) for s in "ab"}
    result["steps_on_link"] = total("steps_on_link")
    result["link_rate_used"] = {
        s: result["link_tx_bytes"][s] * 8 / total("link_window_s") / (args.rate_mbit * 1e6) for s in "ab"
    }  # each side's egress, busy share
    if case != "alone":
        result["kv_MBps_per_direction"] = total("kv_bytes") / total("window_s") / _directions(args) / 1e6
        result["kv_sockets_tos"] = sorted({t for p in parts for t in p["kv_sockets_tos"]})
    if case != "kv_alone":
        result["collective_sockets_tos"] = sorted({t for p in parts for t in p["collective_sockets_tos"]})
    result["bands"] = {
        s: {
            b: {k: sum(p["bands"][s][b][k] for p in parts) for k in parts[0]["bands"][s][b]}
            for b in parts[0]["bands"][s]
        }
        for s in "ab"
    }
    return result


def summarize(results: dict, args) -> dict:
    """Ratios against the unloaded case, KV's share of the link rate the collectives leave, the targets."""
    alone = results["alone"]
    rate_Bps = args.rate_mbit * 1e6 / 8
    # the collectives' bytes on the wire per step on a's egress (KV's sending side; headers and acknowledgements
    # included; b's is the same, the collectives being symmetric)
    per_step = alone["link_tx_bytes"]["a"] / alone["steps_on_link"]
    summary = {"collective_wire_bytes_per_step_each_way": per_step}
    for case in ("no_priorities", "with_priorities"):
        r = results[case]
        for name in ("all_reduce", "all_to_all"):
            r[name]["p50_vs_alone"] = r[name]["p50_ms"] / alone[name]["p50_ms"]
            r[name]["p99_vs_alone"] = r[name]["p99_ms"] / alone[name]["p99_ms"]
        coll_Bps = per_step * r["all_reduce"]["n"] / r["window_s"]
        leftover = rate_Bps - coll_Bps
        r["leftover_MBps_per_direction"] = leftover / 1e6
        r["kv_share_of_leftover"] = r["kv_MBps_per_direction"] * 1e6 / leftover
    wp, np_ = results["with_priorities"], results["no_priorities"]
    summary["targets"] = {"p99_vs_alone_max": 1.2, "kv_share_of_leftover_min": 0.8}
    summary["met"] = {
        "with_priorities_p99_within_1.2x": all(wp[n]["p99_vs_alone"] <= 1.2 for n in ("all_reduce", "all_to_all")),
        "kv_keeps_80pct_of_leftover": wp["kv_share_of_leftover"] >= 0.8,
        "priorities_beat_no_priorities_p99": all(
            wp[n]["p99_ms"] < np_[n]["p99_ms"] for n in ("all_reduce", "all_to_all")
        ),
    }
    return summary


def plot(results: dict, path: Path) -> Path:
    cases = ("alone", "no_priorities", "with_priorities")
    labels = {"alone": "alone", "no_priorities": "KV flood,\nno priorities", "with_priorities": "KV flood,\npriorities"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg(results, path.with_suffix(".svg"), cases)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.2
    for i, (name, stat, color) in enumerate(
        (
            ("all_reduce", "p50_ms", "#9ecae1"),
            ("all_reduce", "p99_ms", "#3182bd"),
            ("all_to_all", "p50_ms", "#fdae6b"),
            ("all_to_all", "p99_ms", "#e6550d"),
        )
    ):
        xs = [k + (i - 1.5) * width for k in range(len(cases))]
        ys = [results[c][name][stat] for c in cases]
        ax.bar(xs, ys, width, label=f"{name} {stat[:3]}", color=color)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.0f}" if y >= 10 else f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(cases)), [labels[c] for c in cases])
    ax.set_ylabel("collective latency (ms)")
    ax.set_yscale("log")
    ax.set_title("gloo collectives (DeepSeek-V3 decode step sizes)")
    ax.legend(fontsize=8)
    kv_cases = ("no_priorities", "with_priorities", "kv_alone")
    kv = [results[c]["kv_MBps_per_direction"] for c in kv_cases]
    bx.bar(range(3), kv, 0.6, color=["#bdbdbd", "#31a354", "#756bb1"])
    left = results["with_priorities"]["leftover_MBps_per_direction"]
    bx.axhline(left, color="k", ls="--", lw=1)
    bx.text(2.4, left, "link rate the\ncollectives leave", fontsize=7, va="bottom", ha="right")
    bx.set_xticks(range(3), ["no priorities", "priorities", "KV alone"], fontsize=8)
    bx.set_ylabel("KV throughput per direction (MB/s)")
    bx.set_title("KV flood (ucx transport)")
    fig.suptitle(
        f"{results['alone']['rate_mbit']:g} Mbit/s link each way, classes by DSCP (htb: collectives first, "
        f"KV takes what is left)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_svg(results: dict, path: Path, cases) -> Path:
    """A plain SVG bar chart of the p99s (no matplotlib)."""
    bars = [(c, n, results[c][n]["p99_ms"]) for c in cases for n in ("all_reduce", "all_to_all")]
    top = max(v for *_, v in bars)
    rows = []
    for i, (c, n, v) in enumerate(bars):
        h = 200 * v / top
        rows.append(
            f'<rect x="{40 + i * 60}" y="{230 - h:.1f}" width="40" height="{h:.1f}" '
            f'fill="{"#3182bd" if n == "all_reduce" else "#e6550d"}"/>'
            f'<text x="{60 + i * 60}" y="{225 - h:.1f}" font-size="9" text-anchor="middle">{v:.1f}</text>'
            f'<text x="{60 + i * 60}" y="245" font-size="8" text-anchor="middle">{c}</text>'
            f'<text x="{60 + i * 60}" y="256" font-size="8" text-anchor="middle">{n}</text>'
        )
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{80 + 60 * len(bars)}" height="270">'
        f'<text x="10" y="14" font-size="11">collective p99 (ms)</text>{"".join(rows)}</svg>'
    )
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["collective", "kv"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dscp", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--send", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="the link's rate, each direction")
    ap.add_argument("--queue-packets", type=int, default=300, help="each priority class's queue (packets)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per rank in each collective")
    ap.add_argument("--gap-ms", type=float, default=30.0, help="compute between two layers' collectives")
    ap.add_argument("--iters", type=int, default=150, help="measured steps per case and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three collective cases, interleaved")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lanes", type=int, default=4, help="KV peer lanes per sender")
    ap.add_argument(
        "--directions",
        choices=["one", "both"],
        default="one",
        help="KV from a to b (a prefill node writing prompts' KV to a decode node), or both ways; with "
        "both, each direction's TCP acknowledgements (low priority, as KV) wait behind the other "
        "direction's KV and the two directions settle at uneven rates",
    )
    ap.add_argument("--kv-nice", type=int, default=0, help="the KV workers' nice value")
    ap.add_argument(
        "--collective-nice",
        type=int,
        default=-10,
        help="the ranks' nice value (every case alike): on a cluster the NICs move KV and the GPUs run "
        "the collectives; here two shared cores do both, and the ranks come first on them as their "
        "packets do on the link",
    )
    ap.add_argument("--kv-ramp-s", type=float, default=3.0)
    ap.add_argument("--kv-alone-s", type=float, default=8.0)
    ap.add_argument("--quick", action="store_true", help="a short run (the slow test's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="the plot's path (default: beside --out, qos.png)")
    args = ap.parse_args(argv)
    if args.worker == "collective":
        _collective_worker(args)
        return {}
    if args.worker == "kv":
        _kv_worker(args)
        return {}
    if args.quick:
        args.iters, args.rounds, args.warmup, args.kv_ramp_s, args.kv_alone_s = 80, 1, 5, 2.0, 4.0
    why = missing()
    if why:
        raise SystemExit(f"bench/qos.py {why}")
    from common import print_table, write_result

    from dualpath.core.config import QosConfig

    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    qos = QosConfig()
    link = Link(qos.kv_dscp, qos.collective_dscp)
    n = args.tokens * HIDDEN * DTYPE_BYTES
    sizes = {
        "all_reduce_bytes": n,
        "all_to_all_bytes_to_other_rank": n,
        "kv_layer_block_bytes": KV_BLOCK_BYTES,
        "kv_write_bytes": BLOCKS_PER_WRITE * KV_BLOCK_BYTES,
    }
    say(
        f"QoS benchmark: {args.rate_mbit:g} Mbit/s link, all-reduce {n / 1024:.0f} KiB and all-to-all "
        f"{n / 1024:.0f} KiB to the other rank every {args.gap_ms:g} ms, {args.iters} steps per case; KV writes of "
        f"{BLOCKS_PER_WRITE} x {KV_BLOCK_BYTES / 1024:.0f} KiB blocks on {args.lanes} lanes per side"
    )

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, interrupted)  # the namespaces go in `finally` on SIGTERM too
    results: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="dpqos-") as logs:
            link.up()
            link.shape(args.rate_mbit, args.queue_packets)
            parts: dict[str, list] = {c: [] for c in CASES}
            for k in range(args.rounds):  # the cases interleaved: the machine's other load falls on all of them
                for case in CASES if k == 0 else CASES[:3]:
                    say(f"round {k + 1}/{args.rounds}: case {case} ...")
                    t = time.monotonic()
                    parts[case].append(run_case(case, link, args, Path(logs), say))
                    say(f"round {k + 1}/{args.rounds}: case {case} done in {time.monotonic() - t:.0f} s")
            results = {c: combine(c, parts[c], args) for c in CASES}
    finally:
        link.down()
        signal.signal(signal.SIGTERM, old_term)
    summary = summarize(results, args)
    rows = []
    for case in CASES[:3]:
        r = results[case]
        rows.append(
            {
                "case": case,
                **{f"{n}_{k}": r[n][k] for n in ("all_reduce", "all_to_all") for k in ("p50_ms", "p99_ms")},
                "ar_p99_x": r["all_reduce"].get("p99_vs_alone", 1.0),
                "a2a_p99_x": r["all_to_all"].get("p99_vs_alone", 1.0),
                "kv_MBps": r.get("kv_MBps_per_direction", 0.0),
                "kv_of_leftover": r.get("kv_share_of_leftover", float("nan")),
            }
        )
    rows.append({"case": "kv_alone", "kv_MBps": results["kv_alone"]["kv_MBps_per_direction"]})
    print_table(
        rows,
        [
            "case",
            "all_reduce_p50_ms",
            "all_reduce_p99_ms",
            "all_to_all_p50_ms",
            "all_to_all_p99_ms",
            "ar_p99_x",
            "a2a_p99_x",
            "kv_MBps",
            "kv_of_leftover",
        ],
    )
    print(
        f"link {args.rate_mbit:g} Mbit/s = {args.rate_mbit / 8:.1f} MB/s per direction; targets met: {summary['met']}"
    )
    config = {
        k: getattr(args, k)
        for k in (
            "rate_mbit",
            "queue_packets",
            "tokens",
            "gap_ms",
            "iters",
            "rounds",
            "warmup",
            "lanes",
            "directions",
            "kv_nice",
            "collective_nice",
            "quick",
        )
    }
    result = {
        "config": config,
        "sizes": sizes,
        "qos": {"kv_dscp": qos.kv_dscp, "collective_dscp": qos.collective_dscp},
        "cases": results,
        **summary,
    }
    path = write_result("qos", result, args.out)
    print("wrote", path)
    picture = Path(args.plot) if args.plot else path.with_name("qos.png")
    print("plot", plot(results, picture))
    return result


if __name__ == "__main__":
    main()
