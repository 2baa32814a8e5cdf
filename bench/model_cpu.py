"""Prefill and decode throughput of SmolLM2-135M: this project's engine against transformers' eager model,
measured in the same run on the same device. Then scoring a prompt (``prompt_logprobs=5``: every position's logprob,
rank and top 5) against the same prefill without it, and against transformers' logits for every position with a
log-softmax and top-5 (how one scores a prompt with it).

    python bench/model_cpu.py [--device cpu] [--dtype float32] [--out bench/results/model_cpu.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, print_table, write_result  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import transformers

    from dualpath import LLM, SamplingParams
    from dualpath.checkpoints.smollm2 import default_model_dir

    model_dir = args.model or str(default_model_dir())
    dtype = getattr(torch, args.dtype)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, max_num_batched_tokens=1 << 16)
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
        .to(args.device)
        .eval()
    )
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batch:
        prompts = torch.randint(100, 40000, (b, args.prefill_tokens), generator=g)
        one = SamplingParams(temperature=0, max_tokens=1)

        def ours_prefill():
            llm.generate(prompts.tolist(), one)
            sync()

        def hf_prefill():
            with torch.no_grad():
                hf(prompts.to(args.device), logits_to_keep=1)
            sync()

        n = args.decode_tokens
        short = prompts[:, :16]
        gen = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

        def ours_decode():
            llm.generate(short.tolist(), gen)
            sync()

        def hf_generate(k):
            with torch.no_grad():
                hf.generate(
                    short.to(args.device),
                    attention_mask=torch.ones_like(short).to(args.device),
                    max_new_tokens=k,
                    min_new_tokens=k,
                    do_sample=False,
                )
            sync()

        t_op, t_hp = best_of(ours_prefill), best_of(hf_prefill)
        # Decode time: generating n tokens minus generating 1 (the prompt's prefill), each side the same way.
        t_os = best_of(lambda: llm.generate(short.tolist(), one))
        hf_short = best_of(lambda: hf_generate(1))
        t_od, t_hd = best_of(ours_decode, 4), best_of(lambda: hf_generate(n), 4)
        toks = b * args.prefill_tokens
        row = {
            "batch": b,
            "prefill_tok_s_ours": toks / t_op,
            "prefill_tok_s_hf": toks / t_hp,
            "decode_tok_s_ours": b * (n - 1) / max(t_od - t_os, 1e-9),
            "decode_tok_s_hf": b * (n - 1) / max(t_hd - hf_short, 1e-9),
        }
        row["prefill_ratio"] = row["prefill_tok_s_ours"] / row["prefill_tok_s_hf"]
        row["decode_ratio"] = row["decode_tok_s_ours"] / row["decode_tok_s_hf"]
        rows.append(row)
    print_table(
        rows,
        [
            "batch",
            "prefill_tok_s_ours",
            "prefill_tok_s_hf",
            "prefill_ratio",
            "decode_tok_s_ours",
            "decode_tok_s_hf",
            "decode_ratio",
        ],
    )
    scoring = score_prompt(llm, hf, torch.randint(100, 40000, (args.prefill_tokens,), generator=g), sync, args.device)
    print_table([scoring], list(scoring))
    result = {
        "model": Path(model_dir).name,
        "device": args.device,
        "dtype": args.dtype,
        "prefill_tokens": args.prefill_tokens,
        "decode_tokens": args.decode_tokens,
        "rows": rows,
        "prompt_logprobs": scoring,
        "target": "ours >= transformers (ratio >= 1) for prefill and decode",
    }
    print("wrote", write_result("model_cpu" if args.device == "cpu" else "model_gpu", result, args.out))
    return result


def score_prompt(llm, hf, prompt: torch.Tensor, sync, device: str) -> dict:
    """Seconds to score one prompt: ours with prompt_logprobs=5, ours without (the prefill alone), transformers'."""
    from dualpath import SamplingParams

    ids = prompt.tolist()

    def ours(k):
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k))
        sync()

    def hf_scores():
        with torch.no_grad():
            lp = hf(prompt[None].to(device)).logits[0, :-1].float().log_softmax(-1)
            lp.gather(1, prompt[1:, None].to(device)), lp.topk(5, dim=-1)
        sync()

    t_with, t_without, t_hf = best_of(lambda: ours(5)), best_of(lambda: ours(None)), best_of(hf_scores)
    return {
        "tokens": len(ids),
        "scored_s": t_with,
        "prefill_only_s": t_without,
        "hf_scored_s": t_hf,
        "cost_vs_prefill": t_with / t_without,
        "speedup_vs_hf": t_hf / t_with,
    }


if __name__ == "__main__":
    main()
