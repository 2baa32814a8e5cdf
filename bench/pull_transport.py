"""What one engine group's pull costs the scheduler's process in gRPC alone, by how the pulls travel: a unary call
each (what ``Pull`` is today) against messages on one open bidi stream per group, each with the wire codec
(``dualpath.core.messages``: a ``PullRequest`` of 8 default ``EngineLoad``s in, an empty ``PullReply`` out) and
with raw bytes (gRPC's own share). The scheduler's real handler does more (``SchedulerCore.pull``); this is the
floor under it. Measured: the server process's CPU seconds (``/proc``) per pull, 144 groups x ``--pulls`` each,
the modes alternated ``--rounds`` times.

Why it matters (issue 53): at 100 requests/s the scheduler spends ~0.6 core on ~690 pulls a second (144 groups
every 0.2 s, ``bench/scheduler_service.py``), and real engines pull every 20 ms.

    python bench/pull_transport.py [--pulls 40] [--rounds 2] [--out bench/results/pull_transport.json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_seconds, print_table, write_result  # noqa: E402

GROUPS, PER_GROUP = 144, 8


def _codecs(codec: bool):
    from dualpath.core.messages import PullReply, PullRequest, from_wire, to_wire

    if not codec:
        return None, None, None, b"x"
    return (lambda b: from_wire(PullRequest, b)), to_wire, (lambda b: from_wire(PullReply, b)), PullReply({})


def serve(codec: bool, ports) -> None:
    import grpc

    decode, encode, _, reply = _codecs(codec)

    async def unary(request, ctx):
        return reply

    async def stream(requests, ctx):
        async for _ in requests:
            yield reply

    async def main():
        server = grpc.aio.server()
        methods = {
            "Pull": grpc.unary_unary_rpc_method_handler(unary, decode, encode),
            "Pulls": grpc.stream_stream_rpc_method_handler(stream, decode, encode),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Pulls", methods),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def pull_all(port: int, mode: str, codec: bool, pulls: int) -> None:
    import grpc

    from dualpath.core.messages import EngineLoad, PullRequest, to_wire

    _, _, decode_reply, _ = _codecs(codec)
    encode = to_wire if codec else None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    def request(g: int):
        if not codec:
            return os.urandom(64)
        loads = [EngineLoad(f"e{g}-{i}", 0, 0, 0, 10**9) for i in range(PER_GROUP)]
        return PullRequest(f"g{g}", loads, f"e{g}-0")

    async def unary_group(g: int) -> None:
        call = channel.unary_unary("/bench.Pulls/Pull", encode, decode_reply)
        for _ in range(pulls):
            await call(request(g))

    async def stream_group(g: int) -> None:
        call = channel.stream_stream("/bench.Pulls/Pulls", encode, decode_reply)()
        for _ in range(pulls):
            await call.write(request(g))
            await call.read()
        await call.done_writing()

    await asyncio.gather(*((unary_group if mode == "unary" else stream_group)(g) for g in range(GROUPS)))
    await channel.close()


def measure(codec: bool, args) -> list[dict]:
    spawn = multiprocessing.get_context("spawn")  # a fresh process: no gRPC state inherited from this one
    ports = spawn.Queue()
    server = spawn.Process(target=serve, args=(codec, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        rows: dict[str, list[float]] = {"unary": [], "stream": []}
        for _ in range(args.rounds):
            for mode in rows:
                c0, t0 = cpu_seconds(server.pid), time.perf_counter()
                asyncio.run(pull_all(port, mode, codec, args.pulls))
                n = GROUPS * args.pulls
                rows[mode].append((cpu_seconds(server.pid) - c0) / n)
                print(f"  {mode:6} {'codec' if codec else 'bytes'}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        server.kill()
    return [
        {"payload": "8 EngineLoads" if codec else "64 raw bytes", "mode": m, "server_us_per_pull": 1e6 * min(v)}
        for m, v in rows.items()
    ]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pulls", type=int, default=40, help="pulls per group per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the modes (the least CPU is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = measure(True, args) + measure(False, args)
    by = {(r["payload"], r["mode"]): r["server_us_per_pull"] for r in rows}
    for r in rows:
        r["ratio_to_unary"] = r["server_us_per_pull"] / by[r["payload"], "unary"]
    print_table(rows, ["payload", "mode", "server_us_per_pull", "ratio_to_unary"])
    result = {"rows": rows, "groups": GROUPS, "engines_per_group": PER_GROUP, "pulls_per_group": args.pulls}
    print("wrote", write_result("pull_transport", result, args.out))
    return result


if __name__ == "__main__":
    main()
