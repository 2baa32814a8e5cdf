"""The engines' sampler on a decode batch: one batched pass against sampling a row at a time.

A batch of ``--batch`` rows over a ``--vocab`` vocabulary, every request with its own seeded generator, in three
mixes: temperature only; temperature with top-p 0.9 and top-k 50; and the same with 5 logprobs. The baseline, timed
in the same run, is what the engine did before: per row, filter (top-k, then sort for top-p), softmax,
``torch.multinomial`` and ``.item()`` (on a GPU, a dozen kernels and a wait per row). Reports seconds per batch and
the speed-up.

Then penalties (repetition 1.1, frequency 0.3, presence 0.2, min_p 0.05) with each row ``--prompt`` prompt tokens
and ``--output`` generated tokens: the sampler's sparse form (the rows' distinct tokens, kept as they grow) against
dense bin counts rebuilt from the token lists every step (vLLM's form), and against the same batch without them.

Last, ``bad_words``: 128 words of 1 to 4 tokens per row, their check by the per-prefix index (``BadWords``)
against a comparison with each word, and the step with them against the same batch without them.

    python bench/sampling.py [--batch 64 --vocab 49152 --prompt 2048 --output 256] [--device cpu]
                             [--out bench/results/sampling.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import best_of, print_table, write_result  # noqa: E402

MIXES = {
    "temperature": dict(temperature=0.8),
    "top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=50),
    "with_logprobs": dict(temperature=0.8, top_p=0.9, top_k=50, logprobs=5),
}


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
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.sampler import make_generator, sample

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
        rows.append(
            {
                "mix": name,
                "batch": batch,
                "vocab": vocab,
                "batched_s": t_ours,
                "row_by_row_s": t_base,
                "speedup": t_base / t_ours,
            }
        )
    return rows


def dense_penalties(logits: torch.Tensor, p, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """The baseline: per-step bin counts over the whole vocabulary, from padded token lists (one value of each
    penalty for the batch, which only flatters it)."""
    b, v = logits.shape
    dev = logits.device

    def padded(lists):
        width = max(len(x) for x in lists)
        return torch.tensor([x + [v] * (width - len(x)) for x in lists], device=dev)

    counts = torch.zeros(b, v + 1, device=dev).scatter_add_(
        1, padded(outputs), torch.ones(b, max(map(len, outputs)), device=dev)
    )[:, :v]
    seen = torch.zeros(b, v + 1, dtype=torch.bool, device=dev).scatter_(1, padded(prompts), True)[:, :v] | (counts > 0)
    r = p.repetition_penalty
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - counts * p.frequency_penalty - (counts > 0) * p.presence_penalty


def run_penalties(batch: int, vocab: int, prompt: int, output: int, device: str, repeats: int = 5) -> dict:
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.sampler import TokenHistory, make_generator, sample

    dev = torch.device(device)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=g).mul_(3).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    prompts = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    outputs = [torch.randint(0, vocab, (output,), generator=g).tolist() for _ in range(batch)]
    knobs = dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)
    params = [SamplingParams(seed=i, min_p=0.05, **knobs) for i in range(batch)]
    plain = [SamplingParams(seed=i, temperature=0.8) for i in range(batch)]
    gens = [make_generator(p) for p in params]
    histories = [TokenHistory(pr, p, out) for pr, p, out in zip(prompts, params, outputs)]
    no_pen = [SamplingParams(seed=i, min_p=0.05, temperature=0.8) for i in range(batch)]

    def ours():
        sample(logits, params, gens, histories=histories)
        sync()

    def dense():
        sample(dense_penalties(logits, params[0], prompts, outputs), no_pen, gens)
        sync()

    def without():
        sample(logits, plain, gens)
        sync()

    t_ours, t_dense, t_plain = best_of(ours, repeats), best_of(dense, repeats), best_of(without, repeats)
    return {
        "batch": batch,
        "vocab": vocab,
        "prompt": prompt,
        "output": output,
        "sparse_s": t_ours,
        "dense_s": t_dense,
        "without_s": t_plain,
        "speedup_vs_dense": t_dense / t_ours,
        "cost_vs_without": t_ours / t_plain,
    }


def run_bad_words(batch: int, vocab: int, output: int, device: str, repeats: int = 5) -> dict:
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.sampler import TokenHistory, make_generator, sample

    dev = torch.device(device)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(batch, vocab, generator=g).mul_(3).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    words = [
        tuple(
            tuple(torch.randint(0, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist())
            for _ in range(128)
        )
        for _ in range(batch)
    ]
    params = [SamplingParams(seed=i, temperature=0.8, bad_words=w) for i, w in enumerate(words)]
    plain = [SamplingParams(seed=i, temperature=0.8) for i in range(batch)]
    gens = [make_generator(p) for p in params]
    histories = [TokenHistory([], p, torch.randint(0, vocab, (output,), generator=g).tolist()) for p in params]

    def indexed():
        for h in histories:
            h.bad_words.banned(h.tail)

    def compared():  # each word against the reply's end, one by one
        for h, ws in zip(histories, words):
            t = tuple(h.tail)
            [w[-1] for w in ws if len(w) - 1 <= len(t) and t[len(t) - len(w) + 1 :] == w[:-1]]

    def step():
        sample(logits, params, gens, histories=histories)
        sync()

    def without():
        sample(logits, plain, gens)
        sync()

    t_index, t_compare = best_of(indexed, repeats), best_of(compared, repeats)
    t_step, t_plain = best_of(step, repeats), best_of(without, repeats)
    return {
        "batch": batch,
        "words": 128,
        "index_s": t_index,
        "compare_s": t_compare,
        "step_s": t_step,
        "without_s": t_plain,
        "index_speedup": t_compare / t_index,
        "cost_vs_without": t_step / t_plain,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.batch, args.vocab, args.device)
    print_table(rows, ["mix", "batch", "vocab", "batched_s", "row_by_row_s", "speedup"])
    pen = run_penalties(args.batch, args.vocab, args.prompt, args.output, args.device)
    print_table(
        [pen], ["batch", "prompt", "output", "sparse_s", "dense_s", "without_s", "speedup_vs_dense", "cost_vs_without"]
    )
    bad = run_bad_words(args.batch, args.vocab, args.output, args.device)
    print_table(
        [bad], ["batch", "words", "index_s", "compare_s", "step_s", "without_s", "index_speedup", "cost_vs_without"]
    )
    path = write_result("sampling", {"device": args.device, "rows": rows, "penalties": pen, "bad_words": bad}, args.out)
    print(f"wrote {path}")
    return {"rows": rows, "penalties": pen, "bad_words": bad}


if __name__ == "__main__":
    main()
