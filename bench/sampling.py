"""The engines' sampler on a decode batch: one batched pass against sampling a row at a time.

A batch of ``--batch`` rows over a ``--vocab`` vocabulary, every request with its own seeded generator, in three
mixes: temperature only; temperature with top-p 0.9 and top-k 50; and the same with 5 logprobs. The baseline, timed
in the same run, is what the engine did before: per row, filter (top-k, then sort for top-p), softmax,
``torch.multinomial`` and ``.item()`` (on a GPU, a dozen kernels and a wait per row). Reports seconds per batch and
the speed-up.

    python bench/sampling.py [--batch 64 --vocab 49152] [--device cpu] [--out bench/results/sampling.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import best_of, print_table, write_result  # noqa: E402

MIXES = {"temperature": dict(temperature=0.8), "top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=50),
         "with_logprobs": dict(temperature=0.8, top_p=0.9, top_k=50, logprobs=5)}


def row_by_row(logits: torch.Tensor, params, generators) -> list[int]:
    """The baseline: each row filtered and drawn on its own, its token read back before the next row."""
    out = []
    for i, p in enumerate(params):
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(row, descending=True)
            probs = ordered.softmax(-1)
            drop = (probs.cumsum(-1) - probs) > p.top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        out.append(int(torch.multinomial(row.softmax(-1), 1, generator=generators[i]).item()))
        if p.logprobs is not None:
            lp = logits[i].log_softmax(-1)
            torch.topk(lp, p.logprobs).indices.tolist()
    return out


def run(batch: int, vocab: int, device: str, repeats: int = 5) -> list[dict]:
    from dualpath.sampling_params import SamplingParams
    from engines.sampler import make_generator, sample

    dev = torch.device(device)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for name, knobs in MIXES.items():
        params = [SamplingParams(seed=i, **knobs) for i in range(batch)]
        host_gens = [make_generator(p) for p in params]
        dev_gens = [torch.Generator(device=dev).manual_seed(i) for i in range(batch)]  # the old per-device ones

        def ours():
            sample(logits, params, host_gens)
            sync()

        def baseline():
            row_by_row(logits, params, dev_gens)
            sync()

        t_ours, t_base = best_of(ours, repeats), best_of(baseline, repeats)
        rows.append({"mix": name, "batch": batch, "vocab": vocab, "batched_s": t_ours, "row_by_row_s": t_base,
                     "speedup": t_base / t_ours})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.batch, args.vocab, args.device)
    print_table(rows, ["mix", "batch", "vocab", "batched_s", "row_by_row_s", "speedup"])
    path = write_result("sampling", {"device": args.device, "rows": rows}, args.out)
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
