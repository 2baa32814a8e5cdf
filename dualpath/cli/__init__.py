"""The ``dualpath`` command. Each subcommand's options are declared once, as fields of option classes
(``dualpath.cli.options``; the groups several commands share in ``dualpath.cli.groups``), and its work is a
function; heavy imports happen inside those functions, so ``dualpath --help`` stays fast."""

from __future__ import annotations

import argparse
import logging
import sys

from dualpath.args import qos_config
from dualpath.cli.cluster import ENGINE, NODE, SCHEDULER, _node_tp, cmd_engine, cmd_node, cmd_scheduler, engine_config
from dualpath.cli.control import (
    CONTROLS,
    StatusOptions,
    UpdateWeightsOptions,
    cmd_control,
    cmd_status,
    cmd_update_weights,
)
from dualpath.cli.jobs import (
    GENERATE,
    ROLLOUT,
    BenchAgenticOptions,
    ConvertOptions,
    QuantizeOptions,
    TraceOptions,
    cmd_bench_agentic,
    cmd_convert_default_model,
    cmd_generate,
    cmd_quantize,
    cmd_rollout,
    cmd_trace,
)
from dualpath.cli.options import ArgumentParser, Options, add_cli_args, opt, options, short_usage
from dualpath.cli.server import FRONTEND, RUN_BATCH, SERVE, cmd_frontend, cmd_run_batch, cmd_serve
from dualpath.cli.simulation import PLAN, SIMULATE, cmd_plan, cmd_simulate

__all__ = ["build_parser", "engine_config", "main", "qos_config", "_node_tp", "_with_config"]


@options
class GlobalOptions(Options):
    log_level: str = opt("INFO", "the logging level: DEBUG, INFO, WARNING or ERROR")


# (name, help, option classes, function), in the order `dualpath -h` lists them
COMMANDS = (
    ("generate", "offline generation in this process (the reference runtime)", GENERATE, cmd_generate),
    ("scheduler", "run the central scheduler (gRPC)", SCHEDULER, cmd_scheduler),
    ("node", "this node's engines of one role (one per device), for multi-node clusters", NODE, cmd_node),
    (
        "status",
        "a running cluster as its scheduler sees it: engines, load, KV use, queues",
        (StatusOptions,),
        cmd_status,
    ),
    (
        "update-weights",
        "a running cluster loads new weights (same model, new values: RL)",
        (UpdateWeightsOptions,),
        cmd_update_weights,
    ),
    *((action, text, (cls,), cmd_control) for action, (text, cls) in CONTROLS.items()),
    (
        "engine",
        "run one prefill or decode engine (one per device, or per --tensor-parallel-size devices)",
        ENGINE,
        cmd_engine,
    ),
    ("serve", "scheduler + prefill/decode engines + OpenAI-compatible server on this host", SERVE, cmd_serve),
    ("rollout", "replay trajectories (JSONL) against a cluster, results to JSONL", ROLLOUT, cmd_rollout),
    (
        "run-batch",
        "run requests in OpenAI's batch format (JSONL) through the server's endpoints, results to JSONL",
        RUN_BATCH,
        cmd_run_batch,
    ),
    ("trace", "generate a synthetic agentic trace like the paper's (Table 2)", (TraceOptions,), cmd_trace),
    ("bench", "benchmarks that drive whole clusters", (BenchAgenticOptions,), cmd_bench_agentic),
    ("plan", "P/D ratios that add no link bottleneck, and link loads of a P/D split", PLAN, cmd_plan),
    ("simulate", "an agentic trace on a simulated P/D cluster placed by the real scheduler", SIMULATE, cmd_simulate),
    ("frontend", "the OpenAI-compatible HTTP server for a running scheduler", FRONTEND, cmd_frontend),
    (
        "convert-default-model",
        "convert SmolLM2-135M-Instruct from its GGUF (done once)",
        (ConvertOptions,),
        cmd_convert_default_model,
    ),
    (
        "quantize",
        "write a checkpoint's linear weights as block-scaled FP8 (DeepSeek's and Qwen's FP8 format): half of "
        "bfloat16's weight bytes",
        (QuantizeOptions,),
        cmd_quantize,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog="dualpath",
        description="DualPath: disaggregated LLM serving for agentic workloads, whose KV cache lives in storage. "
        "`dualpath COMMAND -h` lists a command's options.",
    )
    add_cli_args(ap, GlobalOptions)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help, classes, func in COMMANDS:
        p = sub.add_parser(name, help=help)
        if name == "bench":  # benchmarks are subcommands of their own: dualpath bench agentic
            p = p.add_subparsers(dest="bench", required=True).add_parser(
                "agentic", help="the paper's systems (basic ... dualpath, oracle) on one trace"
            )
        add_cli_args(p, *classes)
        p.usage = short_usage(p)
        p.set_defaults(func=func, **({"action": name} if func is cmd_control else {}))
    return ap


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """``dualpath COMMAND``'s parser."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Options from ``--config FILE.yaml`` (keys: the options' names, ``max_model_len`` or ``max-model-len``)
    become defaults; flags given on the command line win."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    import yaml

    from dualpath.core.errors import ConfigError

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values")
    known = set(vars(args)) - {"command", "func"}
    unknown = sorted(k for k in values if str(k).replace("-", "_") not in known)
    if unknown:
        raise ConfigError(f"{path}: unknown options {unknown}")
    subparser(parser, args.command).set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})
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
