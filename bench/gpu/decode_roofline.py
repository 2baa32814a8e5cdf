"""Decode against its memory roofline (issue 52, item 1): for each model shape, the time of one decode step of the
offline ``LLM``'s engine (Triton kernels, decode on CUDA graphs: the production path, host work and sampling
included) against the bound

    (weight bytes + KV bytes read) / measured copy bandwidth

where the weight bytes are every weight a step reads (each layer's projections and norms, the final norm, the LM
head; of the embedding only the batch's rows, not counted), the KV bytes are every cached token's K and V in every
layer over the timed steps' mean context, and the copy bandwidth is ``bench/gpu/kernels.py``'s (bytes read and
written per second by a device-to-device copy). With a profile of one step: the kernels that took the most device
time, launches per step, and where the GPU sat idle (``kernels.top_kernels``).

Shapes: the 1.1B Llama of ``kernels.py`` and Llama-3-8B's configuration with random weights (built here, no hub),
batch 1, 16 and 64 at contexts of 2K and 16K, bfloat16. A shape whose KV does not fit beside the weights (the 8B at
64 x 16K: 128 GiB) is reported skipped. The sequences' prompt KV is never computed: each joins the decode batch as
a decode engine admits a prefilled prompt (``LocalEngine.admit_prefilled``), its blocks reserved and zero, so that a
16K context costs no prefill (decode reads the same bytes whatever they hold). Targets: the 8B at batch 64 within
1.3x of its bound, the 1.1B within 2x.

    python bench/gpu/decode_roofline.py --out OUT.json [--models llama_1b llama3_8b] [--work DIR] [--smoke]

``--smoke`` runs tiny shapes of both models on CPU in seconds (no graphs, no profile) to check the script;
``--work`` is where the random checkpoints are built (kept for the serving bench of the same run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import machine, print_table  # noqa: E402


def _kernels_bench():
    """``bench/gpu/kernels.py`` as a module of its own name. As ``kernels`` (this folder on ``sys.path``, or the
    repository's ``kernels/`` from its root) it would stand in for Hugging Face's ``kernels`` distribution, which
    transformers imports where that is installed: that one is imported first, from everywhere else on the path."""
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() not in (HERE, ROOT)]
    try:
        with contextlib.suppress(ImportError):
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved
    spec = importlib.util.spec_from_file_location("bench_gpu_kernels", HERE / "kernels.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


kb = _kernels_bench()
sys.path.insert(0, str(HERE))
from roofline import bound_seconds, kv_bytes, weight_bytes  # noqa: E402

BIG, SMOKE, bench_copy, llama_1b, release, top_kernels = (
    kb.BIG,
    kb.SMOKE,
    kb.bench_copy,
    kb.llama_1b,
    kb.release,
    kb.top_kernels,
)

MODELS = ("llama_1b", "llama3_8b")
BLOCK = 64  # the engine's KV block (LLM's default)
TARGETS = {"llama_1b": 2.0, "llama3_8b": 1.3}  # step time / bound at batch 64 (the issue's)


@dataclass(frozen=True)
class Sizes:
    """One run's shapes and step counts."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    warmup: int
    steps: int
    copy_bytes: int  # the copy bandwidth's buffer

    @property
    def max_model_len(self) -> int:
        """The engine's context limit: the longest context and every step after it, with a block to spare."""
        return self.reserved(max(self.contexts)) + BLOCK

    def reserved(self, context: int) -> int:
        """Tokens of cache one sequence of ``context`` holds by its last step: the context, the first token, every
        warm-up, timed and profiled step's token, in whole blocks."""
        return -(-(context + 1 + self.warmup + self.steps + 2) // BLOCK) * BLOCK


FULL = Sizes(batches=(1, 16, 64), contexts=(2048, 16384), warmup=3, steps=20, copy_bytes=BIG["copy_bytes"])
TINY = Sizes(batches=(1, 3), contexts=(40, 100), warmup=1, steps=3, copy_bytes=SMOKE["copy_bytes"])


@functools.lru_cache(maxsize=None)
def llama3_8b(root: Path, smoke: bool, device: str = "cpu") -> Path:
    """Llama-3-8B's configuration with random weights (``smoke``: a toy one of its 4:1 grouped heads), drawn on
    ``device`` (a GPU draws 8B parameters in seconds, a CPU in minutes)."""
    shape = (
        {**kb.TOY_LLAMA, "num_key_value_heads": 1}
        if smoke
        else dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            initializer_range=0.02,
        )
    )
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    return kb.random_llama(root / "llama3-8b", shape, device, max_position_embeddings=32768, rope_parameters=rope)


def model_path(name: str, work: Path, smoke: bool, device: str) -> Path:
    """Model ``name``'s checkpoint in ``work`` (built there once a run: ``kernels.random_llama``)."""
    return llama_1b(work, smoke) if name == "llama_1b" else llama3_8b(work, smoke, device)


def loaded_weight_bytes(model: torch.nn.Module) -> int:
    """The same count from the loaded model's parameters (the check on ``weight_bytes``)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.config.tie_word_embeddings
    return total - (0 if tied else model.embed_tokens.numel() * model.embed_tokens.element_size())


def make_llm(path: Path, dev: torch.device, sizes: Sizes, cache_bytes: int):
    from dualpath import LLM

    return LLM(
        str(path),
        device=str(dev),
        dtype="bfloat16",
        kernels="triton" if dev.type == "cuda" else "torch",
        block_size=BLOCK,
        kv_cache_bytes=cache_bytes,
        max_num_seqs=max(sizes.batches),
        max_num_batched_tokens=2048,
        max_model_len=sizes.max_model_len,
    )


def admit(llm, batch: int, context: int, max_tokens: int, tag: str) -> list:
    """``batch`` sequences of ``context`` prompt tokens whose KV is taken as computed (blocks reserved, zero), each
    with its first token, in the engine's decode batch as a decode engine admits them."""
    from dualpath import SamplingParams
    from dualpath.engines.sequence import Sequence

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(batch * 100_003 + context)
    seqs = []
    for i in range(batch):
        prompt = torch.randint(3, llm.model_config.vocab_size, (context,), generator=g).tolist()
        s = Sequence(f"{tag}-{i}", prompt, params)
        eng.cache.reserve(s.seq_id, context)
        s.num_computed = context
        s.append(prompt[-1], None, eng.eos_ids, eng.max_model_len)
        eng.admit_prefilled(s)
        seqs.append(s)
    return seqs


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure_shape(llm, dev, sizes: Sizes, batch: int, context: int, copy_bps: float, weights: int) -> dict:
    """One shape: seconds per engine step over ``sizes.steps`` steps after ``sizes.warmup``, the bound, and one
    more step profiled."""
    eng = llm.engine
    seqs = admit(llm, batch, context, sizes.warmup + sizes.steps + 3, f"roof-{batch}-{context}")
    try:
        for _ in range(sizes.warmup):
            eng.step()
        sync(dev)
        t = time.perf_counter()
        for _ in range(sizes.steps):
            eng.step()
        sync(dev)
        step = (time.perf_counter() - t) / sizes.steps
        profile = top_kernels(eng.step, dev)
    finally:
        for s in seqs:
            eng.abort(s.seq_id)
    mean_context = context + sizes.warmup + (sizes.steps + 1) / 2  # the timed steps' cached tokens, on average
    kv = kv_bytes(llm.model_config, batch, mean_context)
    bound = bound_seconds(weights, kv, copy_bps)
    return {
        "batch": batch,
        "context": context,
        "step_seconds": step,
        "tokens_per_s": batch / step,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bound_seconds": bound,
        "vs_bound": step / bound,
        "decode_graphs": eng.runner.graphs is not None,
        "launches_per_step": profile.get("launches"),
        "profile": profile,
    }


def cache_budget(dev: torch.device, weights: int) -> int:
    """Bytes the KV cache may take: on CUDA what is free less the weights about to load and 6 GiB of activations
    and graphs' room; on a CPU a bound that tiny shapes never reach."""
    if dev.type != "cuda":
        return 1 << 30
    free, _ = torch.cuda.mem_get_info()
    return int(free - weights * 1.05 - (6 << 30))


def bench_model(name: str, work: Path, dev: torch.device, sizes: Sizes, smoke: bool, copy_bps: float) -> dict:
    from dualpath.engines.models import open_checkpoint

    path = model_path(name, work, smoke, str(dev))
    config = open_checkpoint(str(path)).config
    weights = weight_bytes(config)
    shapes = [(b, n) for n in sizes.contexts for b in sizes.batches]
    need = {(b, n): kv_bytes(config, b, sizes.reserved(n)) for b, n in shapes}
    budget = cache_budget(dev, weights)
    fits = [s for s in shapes if need[s] <= budget]
    rows = [
        {"batch": b, "context": n, "skipped": f"KV {need[(b, n)] / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB free"}
        for b, n in shapes
        if (b, n) not in fits
    ]
    if not fits:
        return {"path": str(path), "rows": rows}
    llm = make_llm(path, dev, sizes, max(need[s] for s in fits))
    try:
        loaded = loaded_weight_bytes(llm.model)
        for b, n in fits:
            rows.append(measure_shape(llm, dev, sizes, b, n, copy_bps, weights))
            print(f"{name} batch {b} context {n}: {rows[-1]['step_seconds'] * 1e3:.2f} ms a step", flush=True)
    finally:
        llm = None
        release(dev)
    rows.sort(key=lambda r: (r["context"], r["batch"]))
    return {"path": str(path), "weight_bytes": weights, "loaded_weight_bytes": loaded, "rows": rows}


def summary(result: dict) -> list[dict]:
    """The table: one line per measured or skipped shape."""
    out = []
    for name in MODELS:
        for r in result.get(name, {}).get("rows", []):
            line = {"model": name, "batch": r["batch"], "context": r["context"]}
            if "skipped" in r:
                line["vs_bound"] = "skipped"
            else:
                line.update(
                    step_ms=r["step_seconds"] * 1e3,
                    bound_ms=r["bound_seconds"] * 1e3,
                    vs_bound=r["vs_bound"],
                    launches=r["launches_per_step"],
                    target=f"<= {TARGETS[name]}" if r["batch"] == 64 else "(report)",
                )
            out.append(line)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--work", default=None, help="where the random checkpoints are built (default: a new temp dir)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes = TINY if args.smoke else FULL
    work = Path(args.work or tempfile.mkdtemp(prefix="dualpath-roofline-"))
    copy = bench_copy({"copy_bytes": sizes.copy_bytes}, dev)
    release(dev)  # (its two buffers, before the KV cache is sized from what is free)
    result = {
        "benchmark": "decode_roofline",
        "machine": machine(),
        "smoke": args.smoke,
        "sizes": asdict(sizes),
        "copy": copy,
        "targets": TARGETS,
    }
    for name in args.models:
        t = time.perf_counter()
        try:
            result[name] = bench_model(name, work, dev, sizes, args.smoke, copy["copy_bytes_per_s"])
        except Exception as e:  # noqa: BLE001 - one model failing must not lose the other's numbers
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name} failed: {result[name]['error']}", flush=True)
        result[name]["wall_seconds"] = time.perf_counter() - t
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print_table(summary(result), ["model", "batch", "context", "step_ms", "bound_ms", "vs_bound", "launches", "target"])
    return result


if __name__ == "__main__":
    main()
