"""Speculative decoding by prompt lookup against plain decoding, same model, same run: SmolLM2 (CPU, float32) on
chat tasks whose replies repeat their prompt (an agent editing code, quoting a document) and on one that does not
(free text, the control), greedy, one sequence at a time (latency) and a batch.

Per task: generated tokens per second of each, the ratio, the share of draft tokens kept, tokens per speculative
step, and whether the outputs are identical (they must be: a draft is kept only where it equals the model's own
token).

    python bench/spec_decode.py [--model DIR] [--max-tokens 160] [--batch 4] [--tokens 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import print_table, write_result  # noqa: E402

CODE = '''def compute_total(items, tax_rate):
    """Sum the prices of the items and add tax."""
    total = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("discount"):
            price = price * (1 - item["discount"])
        total += price
    return round(total * (1 + tax_rate), 2)


def cheapest(items):
    return min(items, key=lambda item: item["price"])
'''
DOC = (
    "The storage bandwidth of every node is used: a request's cached KV is read either by the prefill engine "
    "or by a decode engine, which forwards it to the prefill engine over RDMA. A traffic manager moves the "
    "blocks layer by layer, overlapped with compute, on a low-priority service level."
)
TASKS = {
    "edit code": f"Rename the function compute_total to sum_prices in this code. Reply with the whole code only.\n\n"
    f"{CODE}",
    "quote": f"Repeat the following paragraph word for word, then say nothing else.\n\n{DOC}",
    "free text": "Write a short story about a lighthouse keeper.",
}


def timed(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from dualpath import LLM, SamplingParams
    from dualpath.args import resolve_model

    model = resolve_model(args.model)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.tokens, "prompt_lookup_max": args.lookup_max}
    plain, spec = LLM(model), LLM(model, speculative_config=spec_cfg)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for task, text in TASKS.items():
        prompt = plain.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for batch in (1, args.batch):
            prompts = [prompt] * batch
            timed(plain, prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm both
            timed(spec, prompts[:1], SamplingParams(temperature=0, max_tokens=4))
            before = dict(spec.engine.spec_stats)
            t_plain, want = timed(plain, prompts, params)
            t_spec, got = timed(spec, prompts, params)
            stats = {k: spec.engine.spec_stats[k] - before[k] for k in before}
            tokens = sum(len(o.token_ids) for o in got)
            rows.append(
                {
                    "task": task,
                    "batch": batch,
                    "tokens": tokens,
                    "plain_tok_s": tokens / t_plain,
                    "spec_tok_s": tokens / t_spec,
                    "ratio": t_plain / t_spec,
                    "kept": stats["accepted"] / max(1, stats["drafted"]),
                    "per_step": (stats["accepted"] + batch * stats["steps"]) / max(1, batch * stats["steps"]),
                    "identical": [o.token_ids for o in got] == [o.token_ids for o in want],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print_table(
        rows, ["task", "batch", "tokens", "plain_tok_s", "spec_tok_s", "ratio", "kept", "per_step", "identical"]
    )
    path = write_result("spec_decode", {"model": model, "speculative_config": spec_cfg, "rows": rows}, args.out)
    print(f"wrote {path}")
    if not all(r["identical"] for r in rows):
        sys.exit("speculative decoding changed an output")


if __name__ == "__main__":
    main()
