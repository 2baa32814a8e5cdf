"""LoRA adapters against the base model, same model, same run: SmolLM2 (CPU, float32) with random rank-16 adapters
on every projection (q, k, v, o, gate, up, down), through the reference runtime (``dualpath.LLM``).

Measured: prefill of one long prompt, and greedy decoding of a batch, each with every sequence on the base model,
every sequence under one adapter, and the batch split between the base model and two adapters (rows of one batch
take their own adapter's delta). Per case: seconds (best of the repeats), tokens per second and the ratio to the
base model; and whether each mixed-batch reply is what the same prompt gives alone under its adapter (it must be).

    python bench/lora.py [--model DIR] [--rank 16] [--batch 8] [--max-tokens 48] [--prompt-tokens 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import best_of, print_table, write_result  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Llama-family checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from dualpath import LLM, SamplingParams
    from dualpath.checkpoints.tiny import build_tiny_adapter
    from dualpath.args import resolve_model

    model = resolve_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = {
        name: str(build_tiny_adapter(tmp / name, model, seed=i, rank=args.rank, alpha=2.0 * args.rank, std=0.02))
        for i, name in enumerate(("a", "b"))
    }
    llm = LLM(model, block_size=64, lora_modules=adapters)
    vocab = llm.model_config.vocab_size
    long_prompt = [(i * 7919) % (vocab // 2) + vocab // 4 for i in range(args.prompt_tokens)]  # no special ids
    prompts = [
        llm.tokenizer.encode(f"Request {i}: write about the sea, the wind and ship number {i}.")
        for i in range(args.batch)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(long_prompt, one)  # warm-up: first-call allocations are no case's cost
    cases = {
        "base": [None] * args.batch,
        "one adapter": ["a"] * args.batch,
        "mixed (base, a, b)": [(None, "a", "b")[i % 3] for i in range(args.batch)],
    }
    rows = []
    for name, loras in cases.items():
        got = {}
        prefill_s = best_of(
            lambda: llm.generate(long_prompt, one, lora_request=loras[1 % len(loras)]), args.repeats, warmup=0
        )
        decode_s = best_of(
            lambda: got.update(outs=llm.generate(prompts, greedy, lora_request=loras)), args.repeats, warmup=0
        )
        rows.append(
            {
                "case": name,
                "prefill_s": prefill_s,
                "prefill_tok_s": args.prompt_tokens / prefill_s,
                "decode_s": decode_s,
                "decode_tok_s": args.batch * args.max_tokens / decode_s,
                "outputs": [o.token_ids for o in got["outs"]],
            }
        )
    base = rows[0]
    for r in rows:
        r["prefill_ratio"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["decode_ratio"] = r["decode_tok_s"] / base["decode_tok_s"]
    mixed = rows[2]
    alone = [llm.generate(p, greedy, lora_request=lora)[0].token_ids for p, lora in zip(prompts, cases[mixed["case"]])]
    identical = alone == mixed["outputs"]
    differs = rows[1]["outputs"] != base["outputs"]
    for r in rows:
        del r["outputs"]
    print_table(rows, ["case", "prefill_tok_s", "prefill_ratio", "decode_tok_s", "decode_ratio"])
    print(f"mixed-batch replies identical to each alone: {identical}; adapter replies differ from the base: {differs}")
    result = {
        "model": Path(model).name,
        "rank": args.rank,
        "targets": "q,k,v,o,gate,up,down",
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rows": rows,
        "mixed_identical_to_alone": identical,
        "adapter_changes_replies": differs,
    }
    print(f"wrote {write_result('lora', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
